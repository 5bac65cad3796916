"""``lightning-moe convert``: HF directory -> distributed checkpoint -> HF directory, same logits."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_moe.cli import main  # noqa: E402
from lightning_moe.models import MoELanguageModel  # noqa: E402
from lightning_moe.parallel.checkpoint import META_FILE  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, num_experts=4, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, bos_token_id=3, eos_token_id=5)


def test_convert_round_trip_keeps_weights_and_config(tmp_path):
    torch.manual_seed(0)
    reference = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**CONFIG)).eval()
    reference.save_pretrained(tmp_path / "hf")
    main(["convert", "hf-to-checkpoint", str(tmp_path / "hf"), str(tmp_path / "ckpt")])
    meta = torch.load(tmp_path / "ckpt" / META_FILE, weights_only=True)
    assert meta["global_step"] == 0 and meta["hyper_parameters"]["config"]["add_qkv_bias"]
    main(["convert", "checkpoint-to-hf", str(tmp_path), str(tmp_path / "back"), "--max-shard-size", "50000"])
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (3, 5)  # kept from the original config.json
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want = reference(ids).logits
        torch.testing.assert_close(reloaded(ids).logits, want, rtol=0, atol=0)
        # the checkpoint also loads as the module trained from it would be
        module = MoELanguageModel.from_hf(tmp_path / "back").eval()
        assert ((module(ids) - want).norm() / want.norm()).item() < 1e-4


def test_convert_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "hf-to-checkpoint", str(tmp_path / "missing"), str(tmp_path / "ckpt")])
    assert exit_info.value.code == 2
    assert "config.json does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "checkpoint-to-hf", str(tmp_path), str(tmp_path / "out")])
    assert "is not a lightning_moe checkpoint" in capsys.readouterr().err


def test_cli_fine_tunes_an_hf_directory(tmp_path):
    """``--model.config=HF_DIR``: the model's config comes from config.json and its weights are
    read once the Trainer has built it (a learning rate of 1e-12 keeps them after one step)."""
    from lightning_moe.cli import MoECLI

    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(**{**CONFIG, "vocab_size": 256})  # the embedded corpus' bytes
    reference = transformers.Qwen2MoeForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    cli = MoECLI(args=[
        "fit", f"--model.config={tmp_path / 'hf'}", "--model.learning_rate=1e-12", "--model.warmup_steps=0",
        "--data.seq_length=16", "--data.micro_batch_size=2", "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}",  # its config.yaml
    ])
    module = cli.model
    assert module.hf_source["model_type"] == "qwen2_moe" and module.model_config.max_seq_length == 16
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        want = reference(ids).logits
        assert ((module.eval()(ids) - want).norm() / want.norm()).item() < 1e-4


def test_a_trained_checkpoint_remembers_its_hf_origin(tmp_path):
    """After a fit, the module's checkpoint carries the HF architecture and config.json, so the
    reloaded module's ``save_hf`` writes the same family and token ids."""
    import lightning as L

    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**CONFIG)).save_pretrained(tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf", module_kwargs={"warmup_steps": 0})
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    ids = torch.randint(0, 64, (2, 9))
    trainer.fit(module, torch.utils.data.DataLoader([{"input_ids": ids, "labels": ids.roll(-1, 1)}], batch_size=None))
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    reloaded = MoELanguageModel.load_from_checkpoint(tmp_path / "trained.ckpt")
    assert reloaded.hf_source["model_type"] == "qwen2_moe" and reloaded.hf_source["path"] is None
    reloaded.save_hf(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["bos_token_id"], config["eos_token_id"]) == ("qwen2_moe", 3, 5)
