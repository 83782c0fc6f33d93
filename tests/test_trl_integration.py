"""ZeroAdamW in TRL's GRPOTrainer, RLOOTrainer and DPOTrainer (trl 1.13),
end to end on the CPU: one process at stage 2 against torch.optim.AdamW,
and stage 3 on two gloo ranks under torchrun, gathering the whole model for
generation or staying sharded, with reference and reward models sharded
beside the policy."""
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import trl_workers as workers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_one_process_stage2_matches_torch_adamw(kind):
    zero = workers.train(kind, 3, "zero", stage=2)
    plain = workers.train(kind, 3, "torch")
    assert zero["wrapped"] == "Qwen2ForCausalLM" and zero["accelerator"] == "ZeroAccelerator"
    assert len(zero["losses"]) == 3 and all(math.isfinite(x) for x in zero["losses"])
    assert all(zero["changed"].values())
    for name, value in plain["params"].items():
        torch.testing.assert_close(zero["params"][name], value, atol=1e-5, rtol=0, msg=name)


def test_sleeping_through_generation_trains_the_same():
    awake = workers.train("grpo", 2, "zero", stage=2)
    asleep = workers.train("grpo", 2, "zero", stage=2, sleep=True)
    assert set(asleep["placement"].values()) == {"host"}
    for name, value in awake["params"].items():
        assert torch.equal(asleep["params"][name], value), name


def test_trainer_checkpoints_resume_the_optimizer(tmp_path):
    first = workers.train("grpo", 2, "zero", stage=2, output_dir=str(tmp_path), save_steps=2)
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / "rlhfz_optimizer" / "index.json").is_file()
    assert first["steps"] == 2
    resumed = workers.train("grpo", 3, "zero", stage=2, output_dir=str(tmp_path),
                            resume_from=str(checkpoint))
    assert resumed["steps"] == 3          # two steps' state loaded, one more taken


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path, *args):
    out = tmp_path / "result.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), ROOT, HERE])),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               os.path.join(HERE, "trl_workers.py"), str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_trainer_matches_ddp_with_torch_adamw(tmp_path, stage):
    """The Trainer clears grads with model.zero_grad(), which finds p.grad None
    at stages 2 and 3; the grads in the shards must start over all the same."""
    result = _torchrun(tmp_path, "trainer-parity", "3", str(stage))
    for name, expected in result["torch"].items():
        torch.testing.assert_close(result["zero"][name], expected, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind,mode", [("grpo", "gather"), ("grpo", "unit"),
                                       ("rloo", "gather"), ("rloo", "unit")])
def test_two_ranks_stage3_under_torchrun(tmp_path, kind, mode):
    result = _torchrun(tmp_path, kind, "3", mode)
    assert result["wrapped"] == "Qwen2ForCausalLM"       # not DistributedDataParallel
    assert result["accelerator"] == "ZeroAccelerator"
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
    assert all(result["changed"].values()), [n for n, c in result["changed"].items() if not c]
    assert set(result["placement"].values()) == {"host"}    # awake again after the last sleep


def test_two_ranks_stage3_shard_and_sync_the_reference_and_reward_models(tmp_path):
    """GRPO with a KL term: the reference and reward models TRL prepares are
    sharded as the policy is, and sync_ref_model moves the sharded reference
    as TRL's rule does on whole models, bit for bit."""
    workers.policy().save_pretrained(tmp_path / "policy")
    result = _torchrun(tmp_path, "reference-sync", "3", str(tmp_path / "policy"))
    for kind in ("reference", "reward"):
        # every unit sharded; whole only the params under the threshold (64)
        assert result["local"][kind] < result["whole"][kind] / 10, (kind, result)
    assert result["syncs"] == 3 and result["bitwise"]
    assert len(result["kl"]) == 3 and all(math.isfinite(x) for x in result["kl"])
    assert result["reward_logits_equal"]


def test_two_ranks_stage3_lora_with_a_kl_term_matches_ddp(tmp_path):
    """TRL copies a LoRA model's adapter into a frozen "ref" adapter at
    init through p.data, an empty placeholder at stage 3: the trainer
    gathers the model for its init, and training then follows DDP with
    torch's AdamW."""
    pytest.importorskip("peft")
    zero = _torchrun(tmp_path, "peft-reference", "3", "zero")
    plain = _torchrun(tmp_path, "peft-reference", "3", "torch")
    assert sorted(zero["adapters"]) == sorted(plain["adapters"])
    assert any(".ref." in name for name in zero["adapters"])        # the frozen copy
    for name, value in plain["adapters"].items():
        torch.testing.assert_close(zero["adapters"][name], value, atol=1e-6, rtol=0, msg=name)
    assert len(zero["kl"]) == 3 and zero["kl"][-1] > 0
    torch.testing.assert_close(zero["kl"], plain["kl"], atol=1e-6, rtol=1e-4)


def _relative(mine: dict, theirs: dict) -> float:
    names = sorted(theirs)
    a = torch.cat([mine[n].reshape(-1) for n in names])
    b = torch.cat([theirs[n].reshape(-1) for n in names])
    return float((a - b).norm() / b.norm())


def test_two_ranks_stage3_dpo_with_a_synced_reference_matches_ddp(tmp_path):
    """DPOTrainer builds its reference model from the policy's folder and
    moves it toward the policy every step: sharded at stage 3, both models
    end where DDP with torch's AdamW and whole models ends."""
    workers.policy().save_pretrained(tmp_path / "policy")
    zero = _torchrun(tmp_path, "dpo", "3", f"zero:{tmp_path / 'policy'}")
    plain = _torchrun(tmp_path, "dpo", "3", f"torch:{tmp_path / 'policy'}")
    whole = sum(t.numel() for t in plain["reference"].values())
    assert zero["reference_local"] < whole / 10                # sharded
    for kind in ("policy", "reference"):
        assert sorted(zero[kind]) == sorted(plain[kind])
        assert _relative(zero[kind], plain[kind]) <= 1e-5, kind
    torch.testing.assert_close(zero["losses"], plain["losses"], atol=1e-5, rtol=0)
