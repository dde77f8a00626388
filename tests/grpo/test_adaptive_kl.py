"""--kl-target: the KL coefficient steered toward a target KL (grpo/variants.py adaptive_kl_coef), against the
controller's formula written out; its state (the coefficient) in every record and in checkpoints, so a resumed run
continues it exactly. The settings the harness refuses: tests/harness/test_config.py."""
import pytest
import torch

from grpo.settings import Settings
from grpo.variants import adaptive_kl_coef
from helpers import records


def controller(coef, kl, target, n, horizon):
    """Ziegler et al. (2019), verl AdaptiveKLController, OpenRLHF: the proportional error clipped to +-0.2."""
    error = kl / target - 1
    error = 0.2 if error > 0.2 else -0.2 if error < -0.2 else error
    return coef * (1 + error * n / horizon)


@pytest.mark.parametrize("kl", [0.0, 0.05, 0.09, 0.1, 0.11, 0.5])
def test_the_coefficient_follows_the_controllers_formula(kl):
    cfg = Settings(kl_target=0.1, kl_horizon=640)
    assert adaptive_kl_coef(0.02, kl, 64, cfg) == pytest.approx(controller(0.02, kl, 0.1, 64, 640), rel=1e-12)


def test_the_shortest_horizon_allowed_keeps_the_coefficient_above_0():
    # 4 with a batch of 16 is the shortest the harness accepts (tests/harness/test_config.py)
    cfg = Settings(kl_target=100.0, kl_horizon=4)
    assert adaptive_kl_coef(0.02, 0.0, 16, cfg) == pytest.approx(0.004)


def test_the_coefficient_rises_above_the_target_and_falls_below_it_by_at_most_20_percent_per_horizon():
    cfg = Settings(kl_target=0.1, kl_horizon=64)
    assert adaptive_kl_coef(1.0, 100.0, 64, cfg) == pytest.approx(1.2)
    assert adaptive_kl_coef(1.0, 0.0, 64, cfg) == pytest.approx(0.8)
    assert adaptive_kl_coef(1.0, 0.1, 64, cfg) == 1.0


def test_an_adaptive_kl_run_logs_its_coefficient_and_resumes_it_exactly(tiny_model_dir, tmp_path,
                                                                        clean_env, user_threads):
    import train_lean
    args = ["--model", tiny_model_dir, "--task", "toy", "--batch-size", "8", "--group-size", "4", "--max-new-tokens",
            "8", "--learning-rate", "1e-2", "--kl-coef", "0.1", "--kl-target", "1e-4", "--kl-horizon", "16",
            "--steps", "4", "--eval-interval", "0", "--log-level", "warning", "--save-final", "false"]
    train_lean.main([*args, "--out-dir", str(tmp_path / "straight")])
    train_lean.main([*args, "--steps", "2", "--save-interval", "2", "--out-dir", str(tmp_path / "resumed")])
    state = torch.load(tmp_path / "resumed" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    train_lean.main([*args, "--resume", "--out-dir", str(tmp_path / "resumed")])
    straight, resumed = records(tmp_path / "straight" / "metrics.jsonl"), records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed == straight
    assert straight[0]["kl_coef"] == 0.1
    for before, after in zip(straight, straight[1:]):   # each step's coefficient from the step before's KL
        assert after["kl_coef"] == controller(before["kl_coef"], before["kl"], 1e-4, 8, 16)
    assert state["kl_coef"] == straight[2]["kl_coef"]   # the checkpoint holds the coefficient step 3 trains with
    assert len({r["kl_coef"] for r in straight}) == 4   # it moved each step
