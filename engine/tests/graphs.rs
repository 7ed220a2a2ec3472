//! Decode graphs' protocol end to end on the CPU, whose backend keeps graph bookkeeping without
//! recording anything when `KILN_CPU_EMULATE_GRAPHS=1` (its own test binary: the variable is set
//! for the whole process). Every padded decode step goes through warm-up, record and replay; under
//! tensor parallelism every rank runs each phase on its own backend and the ranks agree on what a
//! phase does, so these runs fail if a rank skips a phase, a gather or a collective.

mod common;

use kiln::backend::cpu::EMULATE_GRAPHS_ENV;
use kiln::runner::{GraphUse, ModelRunner, SamplingSite};
use kiln::speculation::SpecConfig;

fn runner(world: usize, graphs: GraphUse) -> Box<dyn ModelRunner> {
    let model = common::tiny_with_tokenizer("deepseek-v3");
    common::steps::load_runner(
        model,
        SpecConfig::default(),
        SamplingSite::Auto,
        graphs,
        world,
    )
}

#[test]
fn recorded_and_replayed_decode_steps_whole_and_split_over_2_ranks_keep_every_token() {
    // SAFETY: this binary's only test sets it before any backend (or other thread) reads it.
    unsafe { std::env::set_var(EMULATE_GRAPHS_ENV, "1") };
    let prompts: Vec<Vec<u32>> = vec![vec![5, 17, 42, 8, 99], vec![3, 3, 60], vec![71, 2, 30, 11]];
    let (want, buckets) = common::steps::batch_run(runner(1, GraphUse::Off).as_mut(), &prompts, 8);
    assert!(buckets.iter().all(Option::is_none));
    for world in [1, 2] {
        let mut graphed = runner(world, GraphUse::Record { max_bs: 8 });
        let (got, buckets) = common::steps::batch_run(graphed.as_mut(), &prompts, 8);
        // Replayed from the recorded graph of a bucket of four (a bucket reported only while
        // graphs are on: a failed recording would have turned them off).
        assert_eq!(buckets[0], None);
        assert!(
            buckets[1..].iter().all(|&b| b == Some(4)),
            "TP = {world}: {buckets:?}"
        );
        assert_eq!(got, want, "TP = {world}: replayed steps vs eager TP = 1");
    }
}
