//! What every decoder family shares: the context its blocks read, and a model seen as
//! embedding → blocks → head, the shape a checkpointed or sharded forward walks block by block.

use super::rotary::RotaryTables;
use crate::nn::Attention;
use candle_core::{DType, Result, Tensor};

/// What every block of one forward pass shares: the rotary tables for its length and the
/// attention's masking.
#[derive(Debug, Clone)]
pub struct BlockContext {
    /// `(t, head_dim / 2)` cos table, in the activations' dtype.
    pub cos: Tensor,
    /// `(t, head_dim / 2)` sin table, in the activations' dtype.
    pub sin: Tensor,
    /// Causal masking, the sliding window and the padding mask.
    pub attention: Attention,
}

impl BlockContext {
    /// The context of a sequence of `t` tokens whose activations are `dtype`: `rotary`'s first
    /// `t` positions, and `attention` with the padding mask `(b, t)` (0 where a key is padding)
    /// added when one is given.
    pub fn new(
        rotary: &RotaryTables,
        t: usize,
        dtype: DType,
        attention_mask: Option<&Tensor>,
        attention: Attention,
    ) -> Result<BlockContext> {
        let (cos, sin) = rotary.first(t, dtype)?;
        let mask = attention_mask.map(|m| padding_mask(m, t)).transpose()?;
        Ok(BlockContext {
            cos,
            sin,
            attention: Attention { mask, ..attention },
        })
    }
}

/// One block of a decoder: hidden states in, hidden states out.
pub trait Block {
    /// The `VarMap` prefix of the block's weights (`model.layers.3`): the unit ZeRO-3 holds as
    /// slices and gathers for the block's segment ([`crate::activations::segment`]). `None`
    /// (the default) leaves the block's weights whole on every process.
    fn unit(&self) -> Option<&str> {
        None
    }

    /// The block applied to hidden states `x` `(b, t, hidden)`.
    fn forward(&self, x: &Tensor, ctx: &BlockContext) -> Result<Tensor>;
}

/// A causal language model as the parts a forward pass walks: embedding, blocks, head.
pub trait CausalLm {
    /// The model's block (cloned into a checkpointed segment: its weights are shared).
    type Block: Block + Clone + 'static;

    /// The first block's input `(b, t, hidden)` for `input_ids` `(b, t)`.
    fn embed(&self, input_ids: &Tensor) -> Result<Tensor>;

    /// What every block needs for `t` tokens whose activations are `dtype`, with the padding
    /// mask `(b, t)` if given.
    fn context(
        &self,
        t: usize,
        dtype: DType,
        attention_mask: Option<&Tensor>,
    ) -> Result<BlockContext>;

    /// The blocks, in order.
    fn blocks(&self) -> &[Self::Block];

    /// The last block's output to logits `(b, t, vocab)`.
    fn head(&self, hidden: &Tensor) -> Result<Tensor>;

    /// Logits at every position: the embedding, each block in turn, the head.
    fn logits(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        self.head(&self.hidden(input_ids, attention_mask)?)
    }

    /// The last block's output `(b, t, hidden)`: the embedding, then each block in turn.
    fn hidden(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let mut h = self.embed(input_ids)?;
        let ctx = self.context(h.dim(1)?, h.dtype(), attention_mask)?;
        for block in self.blocks() {
            h = run_block(block, &h, &ctx)?;
        }
        Ok(h)
    }

    /// The mean cross-entropy of the logits at every position of `hidden` (the last block's
    /// output, `(b, t, hidden)`) against `labels` `(b, t)`, position `i` against label `i`,
    /// labels equal to `ignore_index` left out; f32.
    ///
    /// By default the [`head`](Self::head)'s logits, then [`crate::nn::cross_entropy`]; a
    /// family whose head is a plain linear layer computes the head and the loss together in
    /// chunks of positions ([`crate::nn::linear_cross_entropy`]), so that the whole
    /// `(b · t × vocab)` logits and their gradient never exist.
    fn head_loss(&self, hidden: &Tensor, labels: &Tensor, ignore_index: i64) -> Result<Tensor> {
        logits_loss(&self.head(hidden)?, labels, ignore_index)
    }

    /// The causal language-modelling loss of `input_ids` against `labels` (both `(b, t)`):
    /// each position's logits predict the next position's label, as transformers' causal
    /// LMs count it ([`crate::models::causal_lm_loss`] on [`logits`](Self::logits)), through
    /// [`head_loss`](Self::head_loss).
    fn causal_lm_loss(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
        ignore_index: i64,
    ) -> Result<Tensor> {
        let h = self.hidden(input_ids, attention_mask)?;
        let (b, t, _) = h.dims3()?;
        if labels.dims() != [b, t] {
            candle_core::bail!(
                "causal_lm_loss: labels {:?} do not match input_ids ({b}, {t})",
                labels.dims()
            )
        }
        if t < 2 {
            return Tensor::zeros((), DType::F32, h.device());
        }
        let h = h.narrow(1, 0, t - 1)?;
        self.head_loss(&h, &labels.narrow(1, 1, t - 1)?, ignore_index)
    }
}

/// The mean cross-entropy of `logits` `(b, t, vocab)` against `labels` `(b, t)`, position by
/// position.
pub(crate) fn logits_loss(logits: &Tensor, labels: &Tensor, ignore_index: i64) -> Result<Tensor> {
    let v = logits.dim(candle_core::D::Minus1)?;
    let n = logits.elem_count() / v.max(1);
    crate::nn::cross_entropy(
        &logits.reshape((n, v))?,
        &labels.flatten_all()?,
        ignore_index,
    )
}

/// Runs `block` on `h`: as a checkpointed segment ([`crate::activations`]) while activation
/// checkpointing is on (under ZeRO-3, with the block's [`unit`](Block::unit) gathered for
/// it), directly otherwise.
pub fn run_block<B>(block: &B, h: &Tensor, ctx: &BlockContext) -> Result<Tensor>
where
    B: Block + Clone + 'static,
{
    if !crate::activations::is_recording() {
        return block.forward(h, ctx);
    }
    let (block, ctx) = (block.clone(), ctx.clone());
    match block.unit().map(str::to_string) {
        Some(unit) => crate::activations::segment(h, &unit, move |x| block.forward(x, &ctx)),
        None => crate::activations::checkpoint(h, move |x| block.forward(x, &ctx)),
    }
}

/// An additive mask `(b, 1, 1, t)` from a 0/1 padding mask `(b, t)`: 0 where a key is kept,
/// −∞ where it is padding.
pub(crate) fn padding_mask(mask: &Tensor, t: usize) -> Result<Tensor> {
    let (b, mt) = mask.dims2()?;
    if mt != t {
        candle_core::bail!(
            "attention_mask {:?} does not match the {t} input tokens",
            mask.shape()
        )
    }
    let keep = mask.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let add: Vec<f32> = keep
        .iter()
        .map(|&k| if k != 0.0 { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    Tensor::from_vec(add, (b, 1, 1, t), mask.device())
}
