use ivme::accelerate;

#[accelerate(grad_accum = 2)]
struct Trainer {
    steps: usize,
}

fn main() {
    let _ = Trainer { steps: 0 }.steps;
}
