use ivme::accelerate;

#[accelerate(grad_accum = 2)]
fn train() {}

#[accelerate]
fn evaluate() -> f32 {
    0.0
}

fn main() {
    train();
    let _ = evaluate();
}
