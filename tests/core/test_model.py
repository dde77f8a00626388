import pytest
import torch

from grpo.model import ModelLoadError, frozen_copy, load_policy, load_tokenizer


def test_tokenizer_pads_left_with_eos_when_it_has_no_pad(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    assert tok.padding_side == "left"
    assert tok.pad_token_id == tok.eos_token_id


def test_policy_loads_in_eval_mode_with_fp32_weights(any_model_dir):
    model = load_policy(any_model_dir, "cpu")
    assert not model.training
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())


def test_reference_is_a_frozen_equal_copy(tiny_model_dir):
    policy = load_policy(tiny_model_dir, "cpu")
    ref = frozen_copy(policy)
    assert not any(p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)  # training the policy must not move the reference
    assert not torch.equal(next(policy.parameters()), next(ref.parameters()))


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_policy(str(tmp_path / "nowhere"), "cpu")
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_unreachable_hub_id_says_the_machine_may_be_offline(monkeypatch):
    import huggingface_hub.constants
    # offline mode answers at once, as a machine without network does after its retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="may be offline"):
        load_tokenizer("no-such-org/no-such-model-lean-grpo")


def test_folder_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load --model"):
        load_policy(str(tmp_path), "cpu")
