//! A checkpoint written after training reads back bit for bit, and a bf16 checkpoint reads back
//! as the round-to-nearest-even image of the master weights.

use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::{self, DataOptions, DatasetSource};
use sluice_engine::model::HostParams;
use sluice_engine::train::{ModelSource, TrainConfig, Trainer, load_model, save_checkpoint};
use sluice_engine::weights::SaveDtype;

#[test]
fn trained_weights_round_trip_bit_for_bit() {
    let model = load_model(&ModelSource::Preset("tiny".into()), 7).expect("preset");
    let demo =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/demo-alpaca.jsonl");
    let options = DataOptions { seq_len: 64, train_on_prompt: false, shuffle_seed: Some(1) };
    let packed = data::load(&DatasetSource::File(demo), &model.tokenizer, &options).expect("data");
    let batches = packed.micro_batches(2).expect("batches");
    let cpu = Cpu;
    let config = TrainConfig { lr: 1e-3, total_steps: 2, ..TrainConfig::default() };
    let mut trainer =
        Trainer::new(&cpu, &model.spec, model.params.clone(), config, 128).expect("trainer");
    trainer.step(&batches[0..1]).expect("step 1");
    trainer.step(&batches[1..2]).expect("step 2");
    assert_ne!(trainer.params, model.params, "training changed nothing");

    let dir = tempfile::tempdir().unwrap();
    let f32_dir = dir.path().join("f32");
    save_checkpoint(&f32_dir, &model, &trainer.params, SaveDtype::F32).expect("save");
    let (spec, loaded) = HostParams::load_dir(&f32_dir).expect("load");
    assert_eq!(spec.layers, model.spec.layers);
    let bits = |p: &HostParams| p.units.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&loaded), bits(&trainer.params));

    let bf16_dir = dir.path().join("bf16");
    save_checkpoint(&bf16_dir, &model, &trainer.params, SaveDtype::Bf16).expect("save bf16");
    let (_, rounded) = HostParams::load_dir(&bf16_dir).expect("load bf16");
    for (a, b) in rounded.units.iter().flatten().zip(trainer.params.units.iter().flatten()) {
        assert_eq!(*a, half::bf16::from_f32(*b).to_f32());
    }
}
