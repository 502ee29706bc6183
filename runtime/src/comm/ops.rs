//! What a collective is, as ranks exchange, compare and report it: its kind, size, root and
//! (for the gradient sync) where the data stands, numbered in each rank's sequence.

use std::fmt;

/// Refuses a mean of integer tensors, which no backend can compute exactly.
pub(crate) fn refuse_integer_mean(
    dtype: candle_core::DType,
    op: super::ReduceOp,
) -> crate::Result<()> {
    if op == super::ReduceOp::Mean && !dtype.is_float() {
        return Err(crate::Error::Comm(
            "a mean of integer tensors is not exact; reduce with Sum and divide as floats".into(),
        ));
    }
    Ok(())
}

/// The collective a rank is in, as ranks compare and report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Op {
    /// Which collective.
    pub kind: OpKind,
    /// How many elements this rank contributes (0 where ranks may legitimately differ).
    pub count: u64,
    /// The root rank of a broadcast (0 otherwise).
    pub root: u64,
    /// Where the data stands at a gradient sync (see `GradientState::position`; 0 otherwise).
    pub position: u64,
}

/// The collectives the MPI backend runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum OpKind {
    /// `all_reduce`.
    AllReduce = 1,
    /// The gradient sync's `all_reduce`.
    GradSync = 2,
    /// `broadcast`.
    Broadcast = 3,
    /// `all_gather`.
    AllGather = 4,
    /// `broadcast_bytes`.
    BroadcastBytes = 5,
    /// `all_gather_bytes`.
    AllGatherBytes = 6,
    /// `barrier`.
    Barrier = 7,
    /// `reduce_scatter_sum_into`.
    ReduceScatter = 8,
    /// `all_gather_into`.
    AllGatherInto = 9,
    /// Joining the NCCL world (`ncclCommInitRank`), itself a collective over every rank.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    NcclInit = 10,
}

impl OpKind {
    pub fn from_code(code: u64) -> Option<OpKind> {
        Some(match code {
            1 => OpKind::AllReduce,
            2 => OpKind::GradSync,
            3 => OpKind::Broadcast,
            4 => OpKind::AllGather,
            5 => OpKind::BroadcastBytes,
            6 => OpKind::AllGatherBytes,
            7 => OpKind::Barrier,
            8 => OpKind::ReduceScatter,
            9 => OpKind::AllGatherInto,
            10 => OpKind::NcclInit,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::GradSync => "gradient all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all_gather",
            OpKind::BroadcastBytes => "broadcast_bytes",
            OpKind::AllGatherBytes => "all_gather_bytes",
            OpKind::Barrier => "barrier (wait_for_everyone)",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGatherInto => "all_gather_into",
            OpKind::NcclInit => "joining NCCL (ncclCommInitRank)",
        }
    }
}

impl Op {
    /// A collective of `count` elements per rank (0 where ranks may differ), rooted at rank 0,
    /// at no data position.
    pub(crate) fn new(kind: OpKind, count: usize) -> Op {
        Op {
            kind,
            count: count as u64,
            root: 0,
            position: 0,
        }
    }

    /// The same collective rooted at `root`.
    pub(crate) fn rooted(self, root: usize) -> Op {
        Op {
            root: root as u64,
            ..self
        }
    }

    /// The same collective where the data stands at `position` (the gradient sync's check).
    pub(crate) fn at(self, position: u64) -> Op {
        Op { position, ..self }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind.name())?;
        match self.kind {
            OpKind::Barrier | OpKind::NcclInit => Ok(()),
            OpKind::Broadcast | OpKind::BroadcastBytes => {
                write!(f, " from rank {}", self.root)?;
                if self.count > 0 {
                    write!(f, " of {} values", self.count)?;
                }
                Ok(())
            }
            _ if self.count > 0 => {
                write!(f, " of {} values", self.count)?;
                // The position packs the backward calls made without a data source (high half)
                // and the index of the batch handed out last, plus one (low half).
                let (calls, batch) = (self.position >> 32, self.position & 0xffff_ffff);
                if batch > 0 {
                    write!(f, " after batch {} of the epoch", batch - 1)?;
                }
                if calls > 0 {
                    write!(f, " after {calls} backward calls")?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// A collective in progress: its number in this rank's sequence and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Current {
    /// How many collectives this rank completed before this one.
    pub seq: u64,
    /// What it is.
    pub op: Op,
}

impl Current {
    /// The five words ranks exchange to show each other where they are.
    pub fn token(&self) -> Token {
        [
            self.seq,
            self.op.kind as u64,
            self.op.count,
            self.op.root,
            self.op.position,
        ]
    }

    /// Reads a token back; `None` for a kind this build does not know.
    pub fn from_token(t: &Token) -> Option<Current> {
        Some(Current {
            seq: t[0],
            op: Op {
                kind: OpKind::from_code(t[1])?,
                count: t[2],
                root: t[3],
                position: t[4],
            },
        })
    }
}

/// A collective as five words: sequence number, kind, count, root, data position.
pub(crate) type Token = [u64; 5];

/// Describes a token for messages, whatever it holds.
pub(crate) fn describe(t: &Token) -> String {
    match Current::from_token(t) {
        Some(c) => c.to_string(),
        None => format!("collective #{} (an unknown call)", t[0] + 1),
    }
}

impl fmt::Display for Current {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "collective #{} ({})", self.seq + 1, self.op)
    }
}
