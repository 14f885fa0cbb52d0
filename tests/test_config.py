"""Config composition and the errors a user sees for a bad config."""

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dcmdp.config import ConfigError, flatten, load_config, resume_conflicts

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_and_overrides_compose():
    cfg = load_config(CONFIGS / "default.yaml", ["algo.minibatches=4", "dual.rule=pid", "seed=7"])
    assert cfg.model.preset == "tiny-moe"
    assert cfg.rollout.precision == "int8"
    assert cfg.algo.minibatches == 4 and cfg.dual.rule == "pid" and cfg.seed == 7
    assert cfg.dual.constraints[0].measure == "abs_prob_diff"
    flat = flatten(cfg)
    assert flat["algo.minibatches"] == "4"
    assert flat["dual.constraints.0.tolerance"] == "0.005"


@pytest.mark.parametrize("override, needle", [
    (["algo.minibatchs=4"], "did you mean 'minibatches'"),
    (["rollout.temprature=0.5"], "did you mean 'temperature'"),
    (["modle.preset=tiny-dense"], "did you mean 'model'"),
])
def test_unknown_key_names_nearest(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, override)


def test_unknown_key_inside_constraint_list(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("dual:\n  constraints:\n    - measure: kl_k3\n      tolerence: 0.01\n")
    with pytest.raises(ConfigError, match=r"dual.constraints\[0\].tolerence.*did you mean 'tolerance'"):
        load_config(p)


@pytest.mark.parametrize("override, needle", [
    (["algo.minibatches=3"], "do not divide the rollout batch"),
    (["dual.constraints=[{measure: kl_k3, tolerance: -0.1}]"], "tolerance"),
    (["dual.constraints=[{measure: kl_k3, lambda_min: 2.0, lambda_max: 1.0, lambda_init: 1.5}]"], "lambda_min"),
    (["rollout.precision=int3"], r"rollout.precision.*int4"),
    (["algo.routing_replay=r3", "model.preset=tiny-dense"], "dense model"),
    (["algo.loss=ppo_clipp"], "did you mean 'ppo_clip'"),
    (["dual.constraints=[{measure: kl_k4}]"], "did you mean 'kl_k3'"),
    (["steps=abc"], "steps"),
    (["algo.samples_per_prompt=1"], "samples_per_prompt"),
    (["dual.measure_at=update"], r"dual.measure_at.*did you mean 'updates'"),
])
def test_bad_values_raise_naming_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, override)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["steps"])


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_loads(name):
    load_config(CONFIGS / name)


@pytest.mark.parametrize("name", sorted(p.name for p in (CONFIGS / "tune").glob("*.yaml")))
def test_every_shipped_tune_file_loads(name):
    from dcmdp.tune import load_tune_config

    cfg = load_tune_config(CONFIGS / "tune" / name)
    load_config(cfg.base, cfg.overrides)


def test_overrides_address_list_elements():
    cfg = load_config(CONFIGS / "default.yaml", ["dual.constraints[0].tolerance=0.001", "dual.constraints[0].lr=50",
                                                 "steps=3"])
    c = cfg.dual.constraints[0]
    assert (c.tolerance, c.lr, c.measure, cfg.steps) == (0.001, 50.0, "abs_prob_diff", 3)


@pytest.mark.parametrize("override, needle", [
    ("dual.constraints[1].lr=2", r"no element 'dual.constraints\[1\]' \(dual.constraints: it has 1 element"),
    ("dual.constraints[0].tolerence=1", "did you mean 'tolerance'"),
    ("dual.constraints[0].lr=abc", r"bad value for 'dual.constraints\[0\].lr'"),
    ("dual.constraints[0].tolerance=-1", "must be >= 0"),
])
def test_bad_list_element_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(CONFIGS / "default.yaml", [override])


@pytest.mark.parametrize("override, needle", [
    (["algo.is_cap=3"], r"'algo.is_cap' was replaced: use algo.tis.cap .*algo.seq_tis.cap"),
    (["algo.is_low=0.9"], r"'algo.is_low' was replaced: use algo.icepop.low .*algo.seq_mask.geo.low"),
    (["algo.is_high=1.1"], r"'algo.is_high' was replaced: use algo.icepop.high .*algo.seq_mask.geo.high"),
    (["algo.is_mode=seq_mis"], r"algo.is_mode.*is_mode=none seq_mask.mode=geo"),
    (["dual.enabled=false"], r"'dual.enabled' was replaced: use dual.rule=off"),
    (["dual.fixed=true"], r"'dual.fixed' was replaced: use dual.rule=fixed"),
    (["rollout.enforce_eager=false"], r"'rollout.enforce_eager' was replaced: use rollout.vllm.enforce_eager"),
    (["rollout.tensor_parallel_size=2"], r"'rollout.tensor_parallel_size' was replaced: use rollout.vllm.tensor_par"),
    (["rollout.drop_finished=false"], r"'rollout.drop_finished' was replaced: use rollout.torch.drop_finished"),
    (["rollout.int4_group_size=16"], r"'rollout.int4_group_size' was replaced: use rollout.torch.int4_group_size"),
    (["algo.clip_low=0.1"], r"'algo.clip_low' was replaced: use algo.ppo_clip.low .*algo.minirl.low .*algo.gspo.low"),
    (["algo.clip_high=0.3"],
     r"'algo.clip_high' was replaced: use algo.ppo_clip.high .*algo.minirl.high .*algo.gspo.high"),
])
def test_replaced_is_keys_name_their_replacement(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, override)


def test_replaced_key_in_a_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  is_mode: tis\n  is_cap: 5.0\n")
    with pytest.raises(ConfigError, match=r"'algo.is_cap' was replaced: use algo.tis.cap"):
        load_config(p)


def test_is_sub_configs_defaults_and_overrides():
    cfg = load_config(None, [])
    assert (cfg.algo.tis.cap, cfg.algo.seq_tis.cap) == (5.0, 5.0)
    assert (cfg.algo.icepop.low, cfg.algo.icepop.high) == (0.5, 5.0)
    assert cfg.algo.seq_mask.mode == "none"
    assert (cfg.algo.seq_mask.geo.low, cfg.algo.seq_mask.geo.high) == (0.999, 1.001)
    assert (cfg.algo.seq_mask.prod.low, cfg.algo.seq_mask.prod.high) == (0.5, 2.0)
    assert cfg.algo.veto.threshold is None and cfg.algo.reject.measure == "none" and cfg.algo.clip_ratio_c == 3.0
    cfg = load_config(None, ["algo.is_mode=icepop", "algo.icepop.high=4", "algo.seq_mask.mode=geo",
                             "algo.seq_mask.geo.low=0.99", "algo.veto.threshold=1e-4", "algo.reject.measure=kl_k3",
                             "algo.reject.bound=0.5", "algo.clip_ratio_c=null"])
    assert cfg.algo.icepop.high == 4.0 and cfg.algo.seq_mask.geo.low == 0.99 and cfg.algo.seq_mask.geo.high == 1.001
    assert cfg.algo.veto.threshold == 1e-4 and cfg.algo.reject.bound == 0.5 and cfg.algo.clip_ratio_c is None


def test_engine_sub_configs_defaults_and_overrides():
    cfg = load_config(None, [])
    t, v = cfg.rollout.torch, cfg.rollout.vllm
    assert (t.int4_group_size, t.quantize_lm_head, t.drop_finished, t.gqa_decode) == (32, False, True, True)
    assert (v.tensor_parallel_size, v.enforce_eager, v.gpu_memory_utilization) == (1, True, 0.5)
    cfg = load_config(None, ["rollout.vllm.enforce_eager=false", "rollout.torch.drop_finished=false"])
    assert cfg.rollout.vllm.enforce_eager is False and cfg.rollout.torch.drop_finished is False
    with pytest.raises(ConfigError, match=r"rollout.vllm.gpu_memory_utilization.*\(0, 1\]"):
        load_config(None, ["rollout.vllm.gpu_memory_utilization=1.5"])


def test_loss_sub_configs_defaults_and_overrides():
    """Each loss has its own clip range: gspo's acts on a length-normalised sequence ratio (the GSPO paper's
    3e-4 / 4e-4), the token losses' on r = pi_theta / pi_old (0.2 / 0.28)."""
    cfg = load_config(None, [])
    assert (cfg.algo.ppo_clip.low, cfg.algo.ppo_clip.high) == (0.2, 0.28)
    assert (cfg.algo.minirl.low, cfg.algo.minirl.high) == (0.2, 0.28)
    assert (cfg.algo.gspo.low, cfg.algo.gspo.high) == (3e-4, 4e-4)
    cfg = load_config(None, ["algo.loss=gspo", "algo.gspo.high=5e-4"])
    assert (cfg.algo.gspo.low, cfg.algo.gspo.high) == (3e-4, 5e-4) and cfg.algo.ppo_clip.low == 0.2


@pytest.mark.parametrize("override, needle", [
    (["algo.reject.measure=kl_k3"], r"algo.reject.bound.*needs a bound"),
    (["algo.reject.measure=seq_log_ratio", "algo.reject.bound=1"], r"algo.reject.measure.*token measure: abs_prob_diff"),
    (["algo.seq_mask.mode=geometric"], r"algo.seq_mask.mode.*none, prod, geo"),
    (["algo.seq_mask.geo.low=1.01"], r"algo.seq_mask.geo.*low <= 1 <= high"),
    (["algo.icepop.high=0.9"], r"algo.icepop.*low <= 1 <= high"),
    (["algo.tis.cap=0.5"], r"algo.tis.cap.*>= 1"),
    (["algo.veto.threshold=1"], r"algo.veto.threshold.*\(0, 1\)"),
    (["algo.clip_ratio_c=1.0"], r"algo.clip_ratio_c.*> 1"),
    (["algo.gspo.low=1"], r"algo.gspo.low.*\[0, 1\)"),
    (["algo.minirl.high=-0.1"], r"algo.minirl.high.*>= 0"),
    (["algo.ppo_clip.hi=0.3"], r"algo.ppo_clip.hi.*did you mean 'high'"),
    (["algo.is_mode=seq_tiss"], r"algo.is_mode.*did you mean 'seq_tis'"),
    (["algo.seq_mask.geo.hgih=2"], r"algo.seq_mask.geo.hgih.*did you mean 'high'"),
])
def test_bad_is_settings_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, override)


def test_inf_means_no_bound_in_the_is_sub_configs():
    cfg = load_config(None, ["algo.tis.cap=inf", "algo.seq_mask.mode=geo", "algo.seq_mask.geo.high=inf",
                             "algo.reject.measure=kl_k3", "algo.reject.bound=inf"])
    assert cfg.algo.tis.cap == cfg.algo.seq_mask.geo.high == cfg.algo.reject.bound == float("inf")
    assert load_config(None, ["algo.is_mode=icepop", "algo.icepop.high=inf"]).algo.icepop.high == float("inf")
    with pytest.raises(ConfigError, match=r"'algo.icepop.low': must be a finite number"):
        load_config(None, ["algo.icepop.low=inf"])


@pytest.mark.parametrize("rule", ["projected", "pid", "fixed", "off"])
def test_dual_rule_names_every_registered_rule(rule, tmp_path):
    assert load_config(None, [f"dual.rule={rule}"]).dual.rule == rule
    # YAML reads a bare off as false, in a config file and in a tune file's space alike
    (tmp_path / "c.yaml").write_text(f"dual:\n  rule: {rule}\n")
    assert load_config(tmp_path / "c.yaml").dual.rule == rule
    from dcmdp.tune import apply_settings

    value = OmegaConf.create(f"v: {rule}").v
    assert apply_settings(load_config(None, []), {"dual.rule": value}).dual.rule == rule
    with pytest.raises(ConfigError, match=r"'dual.rule': unknown 'of'.*did you mean 'off'"):
        load_config(None, ["dual.rule=of"])


@pytest.mark.parametrize("old, rule", [({"dual.enabled": "False", "dual.fixed": "False"}, "off"),
                                       ({"dual.enabled": "True", "dual.fixed": "True"}, "fixed"),
                                       ({"dual.enabled": "True", "dual.fixed": "False"}, "projected")])
def test_a_checkpoint_config_with_the_old_dual_keys_resumes_under_its_rule(old, rule):
    """A checkpoint written before dual.rule named off and fixed records dual.enabled / dual.fixed next to
    dual.rule=projected: resuming it under the rule those keys meant is no conflict, under another rule is."""
    cfg = load_config(None, [f"dual.rule={rule}"])
    saved = {**flatten(cfg), "dual.rule": "projected", **old}
    assert resume_conflicts(saved, cfg) == []
    other = load_config(None, ["dual.rule=pid"])
    assert resume_conflicts(saved, other) == [f"dual.rule: {rule!r} in the checkpoint, 'pid' now"]


@pytest.mark.parametrize("cores, load, want", [
    (2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 7.3, 1), (16, 3.5, 12), (16, 2.49, 14), (1, 0.0, 1),
])
def test_auto_threads_take_the_cores_the_load_leaves_free(cores, load, want):
    from dcmdp.cpu import choose_threads, free_cores

    assert free_cores(cores, load) == want  # max(1, cores - round(load)); round() ties to even: 3.5 -> 4
    n, why = choose_threads("auto", cores, load)
    assert n == want and f"{cores} cores available - {load:.2f} 1-minute load average" in why
    assert choose_threads(3, cores, load) == (3, "threads=3 (fixed in the config)")
    assert choose_threads("auto", cores, None)[0] == cores  # no load average: every core
    # torchrun with 2 processes on this machine: each takes half of the free cores, at least 1
    assert choose_threads("auto", cores, load, ranks=2)[0] == max(1, want // 2)


def test_passive_wait_policy_only_on_a_busy_machine_before_torch_and_never_over_the_users():
    import subprocess
    import sys

    import torch  # noqa: F401  (loaded, as in any process that has started training)

    from dcmdp.cpu import passive_wait_policy

    env = {}
    assert passive_wait_policy(0.2, env) is None and env == {}
    assert passive_wait_policy(1.0, {"OMP_WAIT_POLICY": "ACTIVE"}) is None
    assert "torch is already loaded" in passive_wait_policy(1.0, env) and env == {}
    # in a fresh process the policy set before torch loads is the one its OpenMP runtime reads (OMP_DISPLAY_ENV)
    code = ("import os; from dcmdp.cpu import passive_wait_policy; assert passive_wait_policy(1.0); "
            "os.environ['OMP_DISPLAY_ENV'] = 'TRUE'; import torch; torch.ones(64, 64).sum()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"})
    assert out.returncode == 0, out.stderr
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out.stdout + out.stderr


@pytest.mark.parametrize("value, ok", [("auto", "auto"), ("1", 1), ("4", 4), ("0", None), ("-2", None),
                                       ("two", None), ("true", None)])
def test_threads_accepts_auto_and_positive_ints_and_the_command_exits_2_otherwise(value, ok, tmp_path, monkeypatch):
    from dcmdp.cli import main

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)  # 4 usable cores
    if ok is not None:
        assert load_config(None, [f"threads={value}"]).threads == ok
        return
    with pytest.raises(ConfigError, match="'threads'"):
        load_config(None, [f"threads={value}"])
    assert main(["train", f"threads={value}", f"output_dir={tmp_path}"]) == 2


def test_threads_default_is_auto_and_a_yaml_int_stays_an_int(tmp_path):
    # the dataclass default follows the machine; the default recipe pins one thread (reproducible from the file)
    assert load_config(None, []).threads == "auto" and load_config(CONFIGS / "default.yaml").threads == 1
    (tmp_path / "c.yaml").write_text("threads: 2\n")
    assert load_config(tmp_path / "c.yaml").threads == 2


def _other_value(value):
    """A valid value != ``value`` for a mode's knob (clip ranges and band ends stay on their side of 1)."""
    if value is None:
        return 0.5
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return value + 1.0 if value >= 1 else (0.1 if value == 0 else value * 0.9)


def _knob_overrides(knob):
    """Overrides that give ``knob`` a non-default value; the coupling's A and b only ever come together."""
    if knob in ("dual.coupling.A", "dual.coupling.b"):
        return ["dual.coupling.A=[[1.0]]", "dual.coupling.b=[1.0]"]
    default = load_config(None, [])
    value = default
    for part in knob.split("."):
        value = getattr(value, part)
    return [f"{knob}={_other_value(value)}"]


def _foreign_cases():
    from dcmdp.config import MODE_SELECTORS, mode_knobs

    for sel in MODE_SELECTORS:
        names = sel.names()
        owners = {}
        for mode in names:
            for knob in mode_knobs(sel, mode):
                owners.setdefault(knob, mode)
        for knob, owner in owners.items():
            for selected in names:
                if knob not in mode_knobs(sel, selected):
                    yield pytest.param(sel, owner, knob, selected, id=f"{sel.key}={selected}:{knob}")


def test_mode_selectors_name_their_registries():
    """The selectors' names are the registries' own, so a new mode is covered without touching them."""
    from constraints.measures import MEASURES
    from constraints.penalties import PENALTIES
    from dcmdp.config import MODE_SELECTORS
    from dcmdp.dual import DUAL_RULES
    from trainers.advantages import ADVANTAGES
    from trainers.config import SEQ_MASK_MODES
    from trainers.losses import IS_MODES, POLICY_LOSSES

    registry = {s.key: set(s.names()) for s in MODE_SELECTORS}
    assert registry == {"algo.loss": set(POLICY_LOSSES), "algo.is_mode": set(IS_MODES),
                        "algo.seq_mask.mode": set(SEQ_MASK_MODES), "algo.advantage": set(ADVANTAGES),
                        "algo.reject.measure": {"none"} | {n for n, m in MEASURES.items() if m.kind == "token"},
                        "dual.rule": set(DUAL_RULES), "dual.penalty": set(PENALTIES)}


@pytest.mark.parametrize("sel, owner, knob, selected", list(_foreign_cases()))
def test_a_knob_of_an_unselected_mode_is_an_error(sel, owner, knob, selected):
    """Every knob of every mode, set while another mode is selected, names the knob, its mode and the selected one;
    set with its own mode selected, it loads."""
    overrides = _knob_overrides(knob)
    needs = ["algo.reject.bound=0.5"] if sel.key == "algo.reject.measure" and selected != "none" else []
    named = "dual.coupling.[Ab]" if knob.startswith("dual.coupling.") else knob  # A and b are set together
    with pytest.raises(ConfigError, match=rf"'{named}'.*belongs to {sel.kind} .*'{owner}'.*the selected {sel.kind} "
                                          rf"is '{selected}'"):
        load_config(None, [f"{sel.key}={selected}", *needs, *overrides])
    needs = ["algo.reject.bound=0.5"] if sel.key == "algo.reject.measure" else []
    cfg = load_config(None, [f"{sel.key}={owner}", *needs, *overrides])
    assert cfg is not None


def test_foreign_knobs_of_every_mode_are_collected():
    """The collection above is not empty where a registry has modes with knobs (guards a silently empty test)."""
    keys = {p.values[0].key for p in _foreign_cases()}
    assert {"algo.loss", "algo.is_mode", "algo.seq_mask.mode", "algo.reject.measure", "dual.rule"} <= keys


def test_a_knob_at_its_default_under_another_mode_loads(tmp_path):
    """A resolved config (a run folder's config.yaml, a tune trial's run.yaml) lists every mode's knobs at their
    values; those of unselected modes sit at their defaults, and it loads again."""
    from dcmdp.config import to_yaml

    cfg = load_config(CONFIGS / "qwen3-8b.yaml", ["algo.is_mode=icepop", "algo.icepop.low=0.4", "dual.rule=pid",
                                                  "dual.pid.kp=0.2", "algo.loss=minirl"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    # written at its default while another mode is selected: a no-op, accepted
    assert load_config(None, ["algo.is_mode=none", "algo.tis.cap=5.0"]).algo.is_mode == "none"


def test_a_recipe_knob_under_a_mode_switched_later_is_an_error(tmp_path):
    """The file chose tis with its cap; an override that selects another IS mode leaves that cap unread: refused."""
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  is_mode: tis\n  tis:\n    cap: 3.0\n")
    with pytest.raises(ConfigError, match=r"algo.tis.cap belongs to is_mode 'tis'; the selected is_mode is 'none'"):
        load_config(p, ["algo.is_mode=none"])


def test_train_with_a_stray_knob_exits_2(tmp_path):
    import subprocess
    import sys

    root = CONFIGS.parent
    proc = subprocess.run([sys.executable, "-m", "dcmdp.cli", "train", str(CONFIGS / "tiny-dense.yaml"),
                           f"output_dir={tmp_path / 'run'}", "algo.is_mode=none", "algo.tis.cap=3"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "algo.tis.cap belongs to is_mode 'tis'; the selected is_mode is 'none'" in proc.stderr
    assert not (tmp_path / "run").exists()
