"""The optimizer step's non-finite policy: stop, or skip the update (and say so in the metrics)."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from flux_cp.errors import NonFiniteError, UsageError
from flux_cp.model.optim import apply_update, check_finite
from tests.fakes import step_fused_and_reference

OPTIMIZER = {"fused_adamw": "adamw", "prodigy": "prodigy"}


def _setup(kind: str = "sgd"):
    p = torch.nn.Parameter(torch.ones(3))
    if kind == "sgd":  # not fused: apply_update reads the flag on the host
        optimizer = torch.optim.SGD([p], lr=0.1)
    else:  # the trainer's optimizers: AdamW is fused (the flag stays on the device), Prodigy reads it on the host
        from flux_cp.config.training import TrainConfig
        from flux_cp.model.optim import make_optimizer

        optimizer = make_optimizer(TrainConfig(learning_rate=0.1, optimizer=OPTIMIZER[kind]), [p], global_batch=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    p.grad = torch.ones(3)
    return p, optimizer, scheduler


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x)


def test_a_finite_step_updates():
    p, optimizer, scheduler = _setup()
    assert apply_update(optimizer, scheduler, _t(0.5), _t(1.0)).item() is False
    assert torch.allclose(p.detach(), torch.full((3,), 0.9)) and p.grad is None and scheduler.last_epoch == 1
    check_finite(0.5, 1.0, "stop", 1)  # a finite step: nothing to say


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")  # skipped
@pytest.mark.parametrize("kind", ["sgd", "fused_adamw", "prodigy"])
@pytest.mark.parametrize("loss, grad_norm", [(math.nan, 1.0), (0.5, math.inf), (0.5, math.nan)])
def test_a_non_finite_loss_or_gradient_norm_alone_skips_the_update(kind, loss, grad_norm, caplog):
    """A finite loss with a non-finite gradient norm is skipped too, and reported as skipped."""
    p, optimizer, scheduler = _setup(kind)
    assert apply_update(optimizer, scheduler, _t(loss), _t(grad_norm)).item() is True
    assert torch.equal(p.detach(), torch.ones(3)) and p.grad is None
    assert scheduler.last_epoch == 1, "the schedule advances with the step count"
    with caplog.at_level("WARNING", logger="flux_cp"):
        check_finite(loss, grad_norm, "skip", 3)
    assert "step 3: non-finite loss or gradient norm, update skipped" in caplog.text
    with pytest.raises(NonFiniteError, match=r"at step 3; no checkpoint was written for it"):
        check_finite(loss, grad_norm, "stop", 3)


def test_a_dropped_fused_step_leaves_no_trace_in_adamw_and_reads_nothing_on_the_host(monkeypatch):
    """On the device path a dropped step leaves weights, moments and step count as they were: the next finite
    step equals that of an AdamW that never saw the bad one. And the decision is never read by the host."""
    p, optimizer, scheduler = _setup("fused_adamw")
    q, ref, ref_scheduler = _setup("fused_adamw")
    apply_update(optimizer, scheduler, _t(0.5), _t(1.0))
    apply_update(ref, ref_scheduler, _t(0.5), _t(1.0))

    def no_host_read(*args, **kwargs):
        raise AssertionError("apply_update read a tensor on the host")

    p.grad = torch.full((3,), 2.0)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", no_host_read)
        m.setattr(torch.Tensor, "__bool__", no_host_read)
        m.setattr(torch.Tensor, "tolist", no_host_read)
        dropped = apply_update(optimizer, scheduler, _t(math.nan), _t(1.0))
    assert dropped.item() is True
    assert optimizer.state[p]["step"].item() == 1 and torch.equal(p.detach(), q.detach())
    torch.testing.assert_close(optimizer.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=0, atol=0)
    p.grad, q.grad = torch.full((3,), 0.5), torch.full((3,), 0.5)
    apply_update(optimizer, scheduler, _t(0.5), _t(1.0))
    ref_scheduler.step()  # the dropped step advanced the schedule: so does the reference's
    apply_update(ref, ref_scheduler, _t(0.5), _t(1.0))
    assert not torch.equal(p.detach(), torch.ones(3))  # it moved: the comparison means something
    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert optimizer.state[p]["step"].item() == ref.state[q]["step"].item() == 2


def test_the_trainers_adamw_is_fused_and_steps_like_the_reference_adamw():
    """make_optimizer uses the fused AdamW (fewer host-side launches); it must update as torch's default AdamW."""
    step_fused_and_reference("cpu", [(16, 4), (4, 16), (7,), (3, 3, 2)])


# --- the optimizers diffusers' examples offer: Prodigy and 8-bit AdamW --------------------------------------------


def _bnb_or_skip() -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install -e .[optim])")


def _trainer_optimizer(name: str, params: list, lr: float = 0.1):
    from flux_cp.config.training import TrainConfig
    from flux_cp.model.optim import make_optimizer

    if name == "adamw8bit":
        _bnb_or_skip()
    train = TrainConfig(learning_rate=lr, optimizer="adamw" if name == "adamw8bit" else name,
                        use_8bit_adam=name == "adamw8bit")  # fmt: skip
    return make_optimizer(train, params, global_batch=1)


def _same(a, b) -> bool:
    """Optimizer state dicts (or parts of them) equal to the last bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
@pytest.mark.parametrize("name", ["prodigy", "adamw8bit"])
def test_a_dropped_step_leaves_prodigy_and_8bit_adamw_as_they_were(name):
    """Neither takes fused AdamW's found_inf flag: apply_update reads the step's flag first and does not step them.
    Weights and every piece of state (Prodigy's step-size estimate in its param groups, 8-bit AdamW's quantised
    moments) stay as they were, and the next step equals that of an optimizer that never saw the bad one."""
    import copy

    from flux_cp.model.optim import skips_on_device

    torch.manual_seed(0)
    init = torch.randn(64, 128)  # 8-bit moments need 4096 values or more (bitsandbytes' min_8bit_size)
    p, q = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt, ref = _trainer_optimizer(name, [p]), _trainer_optimizer(name, [q])
    assert not skips_on_device(opt)
    sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in (opt, ref))
    grads = [torch.randn(64, 128) for _ in range(4)]
    for g in grads[:2]:
        p.grad, q.grad = g.clone(), g.clone()
        apply_update(opt, sched, _t(0.5), _t(1.0))
        apply_update(ref, ref_sched, _t(0.5), _t(1.0))
    before, weights = copy.deepcopy(opt.state_dict()), p.detach().clone()
    p.grad = grads[2].clone()
    assert apply_update(opt, sched, _t(math.nan), _t(1.0)).item() is True
    assert torch.equal(p.detach(), weights) and _same(opt.state_dict(), before)
    ref_sched.step()
    p.grad, q.grad = grads[3].clone(), grads[3].clone()
    apply_update(opt, sched, _t(0.5), _t(1.0))
    apply_update(ref, ref_sched, _t(0.5), _t(1.0))
    assert not torch.equal(p.detach(), weights)  # it moved: the comparison means something
    assert torch.equal(p.detach(), q.detach()) and _same(opt.state_dict(), ref.state_dict())


def test_prodigy_is_built_as_diffusers_builds_it_and_says_nothing(capsys):
    """diffusers' examples pass --adam_beta1/2, --adam_weight_decay, --adam_epsilon and the four --prodigy_* flags;
    prodigyopt's own "Using decoupled weight decay" line (every rank, every run) is left out, nothing else."""
    from prodigyopt import Prodigy

    from flux_cp.config.parser import parse_config
    from flux_cp.model.optim import describe, make_optimizer

    cfg = parse_config(["--optimizer", "prodigy", "--adam_beta1", "0.8", "--prodigy_beta3", "0.95",
                        "--prodigy_decouple", "false", "--prodigy_safeguard_warmup", "False"])  # fmt: skip
    capsys.readouterr()
    opt = make_optimizer(cfg.train, [torch.nn.Parameter(torch.ones(3))], global_batch=1)
    assert isinstance(opt, Prodigy) and capsys.readouterr().out == ""
    group = opt.param_groups[0]
    expected = {"lr": 1.0, "betas": (0.8, 0.999), "beta3": 0.95, "weight_decay": 1e-4, "eps": 1e-8,
                "decouple": False, "use_bias_correction": True, "safeguard_warmup": False}  # fmt: skip
    assert {k: group[k] for k in expected} == expected
    assert describe(cfg.train) == (
        "Prodigy (betas 0.8, 0.999; weight decay 0.0001; eps 1e-08; beta3 0.95; decoupled decay off, bias correction "
        "on, safeguard warmup off)"
    )
    make_optimizer(parse_config(["--optimizer", "prodigy"]).train, [torch.nn.Parameter(torch.ones(3))], 1)
    assert "decoupled" not in capsys.readouterr().out  # decoupled with weight decay: the case that prints


def test_the_line_filter_keeps_every_other_line(capsys):
    from flux_cp.model.optim import _without_line

    with _without_line("Using decoupled weight decay"):
        print("Using decoupled weight decay")
        print("something else")
        print("Using decoupled weight decay, and more")
    assert capsys.readouterr().out == "something else\nUsing decoupled weight decay, and more\n"


def test_optimizer_flags_take_diffusers_names_and_values():
    from flux_cp.config.parser import parse_config

    train = parse_config([]).train
    assert (train.optimizer, train.use_8bit_adam, train.prodigy_beta3) == ("adamw", False, None)
    assert train.prodigy_decouple and train.prodigy_use_bias_correction and train.prodigy_safeguard_warmup
    train = parse_config(["--optimizer", "Prodigy", "--prodigy_use_bias_correction", "0",
                          "--learning_rate", "0.5"]).train  # fmt: skip
    assert (train.optimizer, train.prodigy_use_bias_correction, train.learning_rate) == ("prodigy", False, 0.5)
    assert parse_config(["--optimizer", "prodigy", "--max_train_steps", "2"]).train.learning_rate == 1.0
    with pytest.raises(UsageError, match=r"^argument --prodigy_decouple: 'maybe' is not true or false"):
        parse_config(["--prodigy_decouple", "maybe"])
    with pytest.raises(UsageError, match=r"--optimizer: invalid choice: 'adam'.*did you mean adamw\?"):
        parse_config(["--optimizer", "adam"])
    with pytest.raises(UsageError, match=r"--prodigy_beta3 1 is out of range"):
        parse_config(["--optimizer", "prodigy", "--prodigy_beta3", "1"])


def test_prodigy_warnings_as_diffusers_gives_them(capsys):
    from flux_cp.config.parser import parse_config

    parse_config(["--optimizer", "prodigy", "--learning_rate", "1e-4"])
    assert "warning: --learning_rate 0.0001 is low for --optimizer prodigy" in capsys.readouterr().err
    parse_config(["--optimizer", "prodigy"])  # its own default LR: nothing to say
    parse_config(["--prodigy_decouple", "false", "--use_8bit_adam", "--plan"])
    parse_config(["--optimizer", "prodigy", "--use_8bit_adam"])
    err = capsys.readouterr().err
    assert "is low" not in err and "warning: --prodigy_decouple has no effect without --optimizer prodigy" in err
    assert "warning: --use_8bit_adam has no effect with --optimizer prodigy" in err


def test_a_missing_optimizer_package_is_one_line_before_anything_loads(monkeypatch):
    from flux_cp.config.parser import parse_config
    from flux_cp.model.optim import check_optimizer

    # Checked at the start of a run (flux_cp.run.trainer), before any model loads; the planner (--plan) loads none.
    monkeypatch.setitem(sys.modules, "prodigyopt", None)  # as if not installed
    with pytest.raises(UsageError) as e:
        check_optimizer(parse_config(["--optimizer", "prodigy"]).train)
    assert str(e.value) == (
        "--optimizer prodigy needs the prodigyopt package: pip install -e .[optim] (or pip install prodigyopt)"
    )
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(UsageError, match=r"^--use_8bit_adam needs the bitsandbytes package: pip install -e .\[optim\]"):
        check_optimizer(parse_config(["--use_8bit_adam"]).train, "cuda")


def test_8bit_adamw_needs_a_cuda_device_and_neither_optional_optimizer_takes_fsdp(monkeypatch):
    from flux_cp.config.training import TrainConfig
    from flux_cp.model.optim import check_optimizer

    if not torch.cuda.is_available():  # this machine
        with pytest.raises(UsageError, match=r"^--use_8bit_adam needs a CUDA GPU .* trains on the CPU: drop"):
            check_optimizer(TrainConfig(use_8bit_adam=True))
    monkeypatch.setitem(sys.modules, "bitsandbytes", sys.modules.get("bitsandbytes") or types.ModuleType("bnb"))
    eight_bit = TrainConfig(use_8bit_adam=True)
    with pytest.raises(UsageError, match="trains on the CPU"):  # a GPU machine, accelerate told to use the CPU
        check_optimizer(eight_bit, "cpu")
    check_optimizer(eight_bit, "cuda")
    for train, flag in ((eight_bit, "--use_8bit_adam"), (TrainConfig(optimizer="prodigy"), "--optimizer prodigy")):
        with pytest.raises(UsageError, match=f"^{flag} is not supported with FSDP"):
            check_optimizer(train, "cuda", sharded=True)
    check_optimizer(TrainConfig(), "cuda", sharded=True)  # AdamW: any layout


# --- a run that did not train says so -----------------------------------------------------------------------------


def _progress(start: int, skipped: list[bool]):
    from flux_cp.model.optim import Progress

    progress = Progress(start)
    for step, s in enumerate(skipped, start + 1):
        progress.note(step, s)
    return progress


def test_a_run_that_ends_on_a_finite_step_trained():
    assert _progress(2, [False, True, False]).failure([2], "out") is None
    assert _progress(0, [True, False]).failure([], "out") is None


def test_a_run_whose_every_step_was_skipped_did_not_train():
    message = _progress(2, [True, True, True, True]).failure([2], "out/rb")
    assert message.startswith(
        "the run did not train: steps 3-6, every step after the resume at step 2, had a "
        "non-finite loss or gradient norm and were skipped (--on_nonfinite skip)"
    ), message
    assert "no final model or checkpoint was written, and out/rb keeps its earlier outputs" in message
    assert "\n" not in message
    assert _progress(0, [True]).failure([], "o").startswith("the run did not train: step 1, every step after the start")


def test_a_run_that_ends_on_skipped_steps_writes_no_final_weights_and_names_the_checkpoint_before_them():
    # step 3 applied an update whose weights give non-finite losses at steps 4-6: checkpoint-3 holds them
    message = _progress(2, [False, True, True, True]).failure([2, 3], "out/rb")
    assert message.startswith(
        "steps 4-6, the last 3 of the run, had a non-finite loss or gradient norm and were "
        "skipped (--on_nonfinite skip): the weights before them give non-finite losses"
    ), message
    assert "checkpoint-2 is the newest checkpoint before them: resume from it with a lower --learning_rate" in message
    message = _progress(0, [False, True]).failure([], "o")
    assert message.startswith("step 2, the last of the run, had a non-finite loss") and "no checkpoint" in message
