"""Checks the Hugging Face checkpoint tests share: the relative error of logits, and an exported
directory that transformers reloads with the reference's logits and every original tensor."""

import torch

from lightning_moe.models.hf import SafetensorsCheckpoint


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


def assert_reloads_as(reference, out_dir, ids, want):
    """transformers loads ``out_dir`` as ``reference``'s class with ``want``'s logits on ``ids``."""
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert type(reloaded) is type(reference)
    with torch.no_grad():
        assert relative_error(reloaded(ids).logits, want) < 1e-4


def assert_same_tensors(original_dir, exported_dir):
    """Every tensor of the original checkpoint comes back under its name, with its values."""
    with SafetensorsCheckpoint(original_dir) as original, SafetensorsCheckpoint(exported_dir) as exported:
        assert exported.names() == original.names()
        for name in original.names():
            box = [slice(0, n) for n in original.shape(name)]
            torch.testing.assert_close(exported.read(name, box), original.read(name, box), rtol=0, atol=0, msg=name)
