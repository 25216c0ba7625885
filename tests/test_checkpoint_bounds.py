"""Checkpoints and dsa-lite runs cannot make huge work or pass bad weights: a checkpoint's
config is checked like a user config (ranges, types, JSON depth), its weights once wherever
weights are taken (names, shapes, dtypes, finite values), and demo, trace, train-tiny and the
Engine estimate their memory before allocating. Hostile files go through the real CLI in a
subprocess under a 3 GiB address-space limit: exit 2, one stderr line, no traceback."""

from __future__ import annotations

import json
import math
import re
import resource
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from spin_trtllm import SpinConfig
from spin_trtllm.errors import SpinError
from spin_trtllm.harness.config import (MAX_CONTEXT, MAX_FFN, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN,
                                        MAX_LAYERS, MAX_PREFILL_CHUNK, MAX_TOPK, MAX_VOCAB,
                                        MAX_WINDOW, DsaLiteConfig, tiny)
from spin_trtllm.harness.engine import Engine, EngineOptions
from spin_trtllm.harness.engine.memory import engine_bytes, trace_bytes
from spin_trtllm.harness.model import (Caches, check_weights, init_weights, load_checkpoint,
                                       save_checkpoint)
from spin_trtllm.harness.pretrained import DATA
from spin_trtllm.harness.train import stdlib_model_config, train_bytes

AS_LIMIT = 3 << 30
GiB = 1 << 30
# a small model: checkpoints of a few hundred KB, runs of a second
SMALL = tiny().with_overrides(hidden=32, heads=2, head_dim=16, ffn=64, window=32,
                              index_topk=16, dtype="float32")


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def cli(*args, cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spin_trtllm.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          preexec_fn=_limit_memory)


def assert_refused(p: subprocess.CompletedProcess, match: str) -> None:
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("spin-trtllm: error: "), p.stderr[-3000:]
    assert re.search(match, lines[0]), lines[0]


def demo_and_trace(ckpt, tmp_path) -> list[subprocess.CompletedProcess]:
    """The two commands that take --checkpoint, run side by side."""
    demo = ["demo", "--checkpoint", ckpt, "--device", "cpu", "--requests", "1",
            "--prompt-tokens", "24", "--new-tokens", "2", "--batch", "1", "--quiet"]
    trace = ["trace", tmp_path / "t.safetensors", "--checkpoint", ckpt, "--device", "cpu",
             "--prompt-tokens", "24", "--steps", "2", "--quiet"]
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda a: cli(*a, cwd=tmp_path), (demo, trace)))


def write_raw(path, config, tensors=None) -> None:
    """A checkpoint with this config text (or dict) in its metadata, written by safetensors."""
    text = config if isinstance(config, str) else json.dumps(config)
    save_file(tensors or {"embed": torch.zeros(1)}, str(path),
              metadata={"format": "dsa-lite", "config": text})


def small_config(**changes) -> dict:
    return {**json.loads(SMALL.to_json()), **changes}


# ---- the config of a checkpoint -------------------------------------------------------------
HOSTILE_CONFIGS = {
    "huge window": small_config(window=10 ** 9),
    "window one over": small_config(window=MAX_WINDOW + 1),
    "huge prefill_chunk": small_config(prefill_chunk=10 ** 6),
    "huge index_topk": small_config(index_topk=MAX_TOPK + 1),
    "huge max_context": small_config(max_context=1 << 40),
    "huge vocabulary": small_config(vocab_size=MAX_VOCAB + 1),
    "huge hidden": small_config(hidden=MAX_HIDDEN + 1),
    "huge heads": small_config(heads=MAX_HEADS + 1),
    "huge head_dim": small_config(head_dim=MAX_HEAD_DIM + 2),
    "huge ffn": small_config(ffn=MAX_FFN + 1),
    "too many layers": small_config(compress_ratios=[1] * (MAX_LAYERS + 1)),
    "negative seed": small_config(seed=-1),
    "window as a string": small_config(window="128"),
    "window as a float": small_config(window=128.0),
    "window as a bool": small_config(window=True),
    "ratio as a bool": small_config(compress_ratios=[1, True]),
    "deep JSON": '{"compress_ratios": ' + "[" * 100 + "]" * 100 + "}",
    "very deep JSON": "[" * 60000,
    "NaN rope_theta": json.dumps(small_config(rope_theta=1.0)).replace("1.0", "NaN"),
    "infinite rope_theta": json.dumps(small_config(rope_theta=1.0)).replace("1.0", "1e999"),
    "repeated key": '{"window": 8, "window": 1000000000}',
    "5000-digit integer": '{"window": ' + "9" * 5000 + "}",
    "not JSON": "{window: 8",
    "not a mapping": "[1, 2]",
    "unknown key": small_config(depth=3),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
def test_hostile_checkpoint_configs_are_refused_before_any_tensor_is_read(name, tmp_path):
    path = tmp_path / "bad.safetensors"
    write_raw(path, HOSTILE_CONFIGS[name])
    with pytest.raises(SpinError, match="config"):
        load_checkpoint(path)


CLI_CONFIGS = ["huge window", "huge prefill_chunk", "huge index_topk", "window as a string",
               "very deep JSON"]


@pytest.mark.parametrize("name", CLI_CONFIGS)
@pytest.mark.slow
def test_hostile_checkpoint_configs_exit_2_through_demo_and_trace(name, tmp_path):
    path = tmp_path / "bad.safetensors"
    write_raw(path, HOSTILE_CONFIGS[name])
    for p in demo_and_trace(path, tmp_path):
        assert_refused(p, "config")


def test_config_bounds_each_dimension():
    base = tiny()
    at_max = dict(vocab_size=MAX_VOCAB, hidden=MAX_HIDDEN, heads=MAX_HEADS,
                  head_dim=MAX_HEAD_DIM, ffn=MAX_FFN, window=MAX_WINDOW, index_topk=MAX_TOPK,
                  max_context=MAX_CONTEXT, prefill_chunk=MAX_PREFILL_CHUNK)
    for field, hi in at_max.items():
        assert getattr(base.with_overrides(**{field: hi}), field) == hi   # nothing allocated
        with pytest.raises(SpinError, match=field):
            base.with_overrides(**{field: hi + 2})
    base.with_overrides(compress_ratios=(1,) * MAX_LAYERS)
    for bad in (dict(init_std=math.inf), dict(rope_theta=math.nan), dict(seed=1 << 64)):
        with pytest.raises(SpinError):
            base.with_overrides(**bad)
    with pytest.raises(SpinError, match="keys must be strings"):
        DsaLiteConfig.from_dict({1: 2})


def test_shipped_checkpoints_still_load():
    shipped = sorted(DATA.glob("dsa_lite_*.safetensors"))
    assert len(shipped) == 4
    for path in shipped:
        cfg, weights = load_checkpoint(path)
        check_weights(cfg, weights)
        assert cfg.max_context <= MAX_CONTEXT and cfg.index_topk <= MAX_TOPK
        assert all(w.dtype == torch.float32 for w in weights.values())


# ---- the weights ------------------------------------------------------------------------------
def _set(w, name, fn):
    w[name] = fn(w[name].clone())
    return w


def _nan(t):
    t.view(-1)[3] = math.nan
    return t


def _inf(t):
    t.view(-1)[-1] = -math.inf
    return t


BAD_WEIGHTS = {
    "NaN": (lambda w: _set(w, "layers.1.wq", _nan), "NaN or infinite"),
    "infinity": (lambda w: _set(w, "lm_head", _inf), "NaN or infinite"),
    "infinite norm": (lambda w: _set(w, "layers.0.attn_norm", _inf), "NaN or infinite"),
    "wrong shape": (lambda w: _set(w, "layers.0.wk", lambda t: t[:, :-1]), "shape"),
    "[1]-shaped norm": (lambda w: _set(w, "final_norm", lambda t: torch.ones(1)), "shape"),
    "transposed": (lambda w: _set(w, "lm_head", lambda t: t.T.contiguous()), "shape"),
    "missing tensor": (lambda w: {k: v for k, v in w.items() if k != "layers.2.w2"}, "missing"),
    "extra tensor": (lambda w: {**w, "layers.9.wq": w["layers.0.wq"].clone()}, "unexpected"),
    "integer dtype": (lambda w: _set(w, "embed", lambda t: t.to(torch.int32)), "dtype"),
}


def bad_weights(name: str) -> dict:
    return BAD_WEIGHTS[name][0](init_weights(SMALL))


@pytest.mark.parametrize("name", sorted(BAD_WEIGHTS))
def test_bad_weights_are_refused_by_the_engine_and_the_loader(name, tmp_path):
    w, match = bad_weights(name), BAD_WEIGHTS[name][1]
    with pytest.raises(SpinError, match=match):
        Engine(SMALL, None, weights=w)
    with pytest.raises(SpinError, match=match):
        check_weights(SMALL, w)
    path = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in w.items()}, str(path),
              metadata={"format": "dsa-lite", "config": SMALL.to_json()})
    with pytest.raises(SpinError, match=match if match != "dtype" else "stored as"):
        load_checkpoint(path)


CLI_WEIGHTS = ["NaN", "infinity", "wrong shape", "[1]-shaped norm", "missing tensor",
               "extra tensor"]


@pytest.mark.parametrize("name", CLI_WEIGHTS)
@pytest.mark.slow
def test_bad_weights_exit_2_through_demo_and_trace(name, tmp_path):
    path = tmp_path / "bad.safetensors"
    save_checkpoint(path, SMALL, bad_weights(name))
    for p in demo_and_trace(path, tmp_path):
        assert_refused(p, BAD_WEIGHTS[name][1])


@pytest.mark.slow
def test_zero_weights_are_refused_at_the_first_prompt(tmp_path):
    # finite, the right shapes, but every logit equal: each argmax would be token 0 (and the
    # demo would report 100% agreement)
    path = tmp_path / "zero.safetensors"
    save_checkpoint(path, SMALL, {k: torch.zeros_like(v) for k, v in init_weights(SMALL).items()})
    for p in demo_and_trace(path, tmp_path):
        assert_refused(p, "all equal")


def test_weights_the_engine_takes_are_checked_whole():
    w = init_weights(SMALL)
    for bad, match in ((3, "mapping"), ([1, 2], "mapping"),
                       ({**w, "embed": w["embed"].tolist()}, "not a tensor"),
                       ({**w, "embed": torch.empty(w["embed"].shape, device="meta")}, "dense"),
                       ({**w, 7: w["embed"]}, "names must be strings")):
        with pytest.raises(SpinError, match=match):
            Engine(SMALL, None, weights=bad)
    # float64 values a float32 model would turn into infinities
    big = _set(init_weights(SMALL), "embed", lambda t: t.double() * 1e300)
    with pytest.raises(SpinError, match="range"):
        Engine(SMALL, None, weights=big)
    # an MTP head the config does not use is allowed (a checkpoint trained with one)
    with_head = init_weights(SMALL.with_overrides(mtp_depth=1))
    check_weights(SMALL, with_head)
    with pytest.raises(SpinError, match="missing"):
        check_weights(SMALL.with_overrides(mtp_depth=1), init_weights(SMALL))


# ---- buffers sized by the config's products --------------------------------------------------
@pytest.mark.slow
def test_in_range_config_whose_buffers_cannot_fit_is_refused_with_one_line(tmp_path):
    # every field in range, each buffer product huge: rings of window + prefill_chunk, 2M-token
    # compressed caches, 1M-slot top-K
    cfg = SMALL.with_overrides(hidden=8, heads=8, head_dim=MAX_HEAD_DIM, ffn=8,
                               window=MAX_WINDOW, prefill_chunk=MAX_PREFILL_CHUNK,
                               index_topk=MAX_TOPK, max_context=MAX_CONTEXT)
    with pytest.raises(SpinError, match="needs about"):
        Engine(cfg, None)
    path = tmp_path / "wide.safetensors"
    save_checkpoint(path, cfg, init_weights(cfg))
    for p in demo_and_trace(path, tmp_path):
        assert_refused(p, "needs about")


def test_cache_estimate_matches_what_the_caches_allocate():
    for cfg, requests, pages in ((tiny(), 3, 40), (SMALL.with_overrides(
            compress_ratios=(4, 0, 4, 64, 4), window=100, prefill_chunk=7), 2, 9)):
        caches = Caches(cfg, requests, pages, torch.device("cpu"))
        table = caches.block_table.numel() * 4
        assert Caches.estimate_bytes(cfg, requests, pages) == \
            caches.nbytes() + table + 36 * pages


@pytest.mark.slow
def test_engine_estimate_stays_above_a_measured_run(tmp_path):
    script = textwrap.dedent("""
        import torch
        from spin_trtllm.harness.engine import Engine, EngineOptions, Request
        from spin_trtllm.harness.engine.memory import engine_bytes
        from spin_trtllm.harness.model import load_checkpoint
        from spin_trtllm.harness.pretrained import STDLIB_CHECKPOINT
        def rss(key):
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                        if l.startswith(key))
        cfg, w = load_checkpoint(STDLIB_CHECKPOINT)
        cfg = cfg.with_overrides(mtp_depth=0, max_context=1024 + 16)
        est = engine_bytes(cfg, None, EngineOptions(trace_request=0).resolve(None,
                           torch.device("cpu")))
        base = rss("VmRSS")
        e = Engine(cfg, None, weights=w, trace_request=0)
        e.run([Request(bytes(i % 251 for i in range(1024)), max_new_tokens=4, request_id=0)])
        print(rss("VmHWM") - base, est)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    measured, estimated = map(int, p.stdout.split()[-2:])
    assert measured < estimated < 3 * measured + (256 << 20)


# ---- train-tiny and trace: the examples ------------------------------------------------
@pytest.mark.slow
def test_train_tiny_refuses_what_cannot_fit(tmp_path):
    p = cli("train-tiny", "--seq-len", 16384, "--batch", 2, "--device", "cpu", "--seconds", 1,
            "--out", tmp_path / "m.safetensors", "--card", tmp_path / "card.md", cwd=tmp_path,
            timeout=120)
    assert_refused(p, r"--batch 2 x --seq-len 16,384 .* needs about")
    assert not (tmp_path / "m.safetensors").exists()


def test_train_estimate_matches_the_h200_measurements():
    # measured on an H200 (bf16 autocast, max_memory_reserved): 8 x 4096 took 51 GiB, 1 x 16384
    # 99 GiB, 2 x 16384 ran out of its 140 GiB
    ratio1 = stdlib_model_config(max_context=65536)
    assert 51 * GiB < train_bytes(ratio1, 8, 4096, "cuda") < 64 * GiB
    assert 99 * GiB < train_bytes(ratio1, 1, 16384, "cuda") < 120 * GiB
    assert train_bytes(ratio1, 2, 16384, "cuda") > 140 * GiB
    assert train_bytes(ratio1, 1, 4096, "cpu") > 6 * GiB     # 6.0 GiB measured


@pytest.mark.parametrize("prompt,steps,match", [
    (1 << 20, 1 << 16, "over the 64 GiB a v2 trace may have"),
    (1 << 18, 2048, "needs about"),                       # 13 GB of recorded scores
])
@pytest.mark.slow
def test_trace_refuses_what_cannot_fit(prompt, steps, match, tmp_path):
    p = cli("trace", tmp_path / "t.safetensors", "--prompt-tokens", prompt, "--steps", steps,
            "--device", "cpu", "--quiet", cwd=tmp_path, timeout=120)
    assert_refused(p, match)
    assert not (tmp_path / "t.safetensors").exists()


def test_trace_estimate_counts_every_steps_scores():
    cfg = tiny().with_overrides(mtp_depth=0)
    host, file = trace_bytes(cfg, 1 << 20, 1 << 16)
    layers = len(cfg.csa_layers)
    assert file > (1 << 16) * layers * (1 << 20) // cfg.index_ratio * 4
    assert host >= 2 * file
    opts = EngineOptions(trace_request=0).resolve(None, torch.device("cpu"))
    assert engine_bytes(cfg.with_overrides(max_context=MAX_CONTEXT), None, opts) > \
        engine_bytes(cfg, None, opts)


def test_engine_estimate_counts_no_vd_for_the_probe_and_gauss():
    """The probe's and gauss's state has no V/D and their MTP step keeps one layer's logits:
    the estimate drops at least the V/D of the growing pool (1.5x)."""
    cfg = tiny().with_overrides(max_context=MAX_CONTEXT)
    spin = SpinConfig(state_dtype="float32")
    opts = {p: EngineOptions(predictor=p, switch="spin").resolve(spin, torch.device("cpu"))
            for p in ("spin", "hybrid", "probe", "gauss")}
    est = {p: engine_bytes(cfg, spin, o) for p, o in opts.items()}
    L, R = len(cfg.csa_layers), cfg.next_n
    requests = opts["spin"].max_requests or opts["spin"].max_batch
    vd = requests * L * (cfg.index_slots + R) * 2 * 4
    assert est["probe"] == est["gauss"] < est["hybrid"] - vd
    assert est["spin"] - est["probe"] >= vd * 3 // 2         # the growing pool's 1.5x
