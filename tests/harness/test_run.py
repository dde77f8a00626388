"""harness/run.py's own promises that no other module's tests cover."""
import subprocess
import sys

import pytest
import torch

from helpers import TRAIN, user_env


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch build has no MKL")
def test_mkl_runs_in_its_reproducible_mode_unless_the_user_chose(tiny_model_dir, tmp_path):
    """Every MKL call of a run is in conditional-numerical-reproducibility mode (MKL_VERBOSE prints it per call):
    MKL then no longer picks kernels by buffer alignment, one cause of same-seed runs drifting apart."""
    args = [sys.executable, TRAIN, "--model", tiny_model_dir, "--task", "toy", "--steps", "1", "--batch-size", "4",
            "--group-size", "2", "--max-new-tokens", "4", "--eval-interval", "0", "--save-final", "false"]

    def modes(out, **extra):
        proc = subprocess.run([*args, "--out-dir", str(tmp_path / out)], env=user_env(MKL_VERBOSE="1", **extra),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return {w for w in (proc.stdout + proc.stderr).split() if w.startswith("CNR:")}

    assert modes("default") == {"CNR:AUTO"}
    assert modes("chosen", MKL_CBWR="COMPATIBLE") == {"CNR:COMPATIBLE"}
