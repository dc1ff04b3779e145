"""fastddp.settings: every environment variable, one truthiness rule, clear
errors for bad values, read once (reload to re-read), and configure()."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch

import fastddp
from fastddp import settings
from fastddp.settings import NativeMode, Settings
from tests._dist import fastddp_only, single_rank_group

SWITCHES = {  # variable -> (field, default)
    "FASTDDP_DEBUG": ("debug", False),
    "FASTDDP_NVTX": ("nvtx", False),
    "PYTORCH_DDP_USE_SIDE_STREAM": ("use_side_stream", True),
    "DDP_SET_LAST_BUCKET_CAP": ("set_last_bucket_cap", False),
}


def _read(name: str, raw):
    """The field of ``name`` in a snapshot of an environment holding only ``name=raw``."""
    var = next(v for v in settings.VARIABLES if v.name == name)
    return getattr(Settings.from_environment({} if raw is None else {name: raw}), var.field)


@pytest.fixture
def env(monkeypatch):
    """Set variables and re-read the settings; the snapshot is re-read after the test too."""
    def set_(**values):
        for k, v in values.items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)
        return settings.reload()
    yield set_
    monkeypatch.undo()
    settings.reload()


# ------------------------------------------------------------- the one table
def test_the_table_documents_every_variable_and_every_field():
    documented = re.findall(r"^\| `([A-Z_]+)` \|", settings.__doc__, re.M)
    assert documented == [v.name for v in settings.VARIABLES]
    assert [f.name for f in Settings.__dataclass_fields__.values()] == [v.field for v in settings.VARIABLES]
    # the defaults: the table's, the dataclass's and the parser's agree
    assert Settings.from_environment({}) == Settings()


def test_every_variable_the_library_names_is_in_the_table():
    src = Path(fastddp.__file__).parent
    read = re.compile(r"""environ(?:\.get\(|\[)\s*["']([A-Z_]+)["']""")
    named = {n for p in src.rglob("*.py") for n in read.findall(p.read_text())}
    assert named <= {v.name for v in settings.VARIABLES}, named


# These still read os.environ themselves; their readers are settings.get().chunk_bytes,
# .native / .cxx and fastddp.settings.default("bucket_cap_mb") (config.py passes it).
_NOT_YET_SWITCHED: set = set()


def test_only_settings_reads_the_environment():
    src = Path(fastddp.__file__).parent
    readers = {p.name for p in src.rglob("*.py") if "os.environ" in p.read_text() or "getenv" in p.read_text()}
    assert readers - _NOT_YET_SWITCHED == {"settings.py"}, readers


# -------------------------------------------------------- the truthiness rule
@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("raw, want", [
    *[(w, False) for w in ("0", "false", "off", "no", "FALSE", "Off", " no ")],
    *[(w, True) for w in ("1", "true", "on", "yes", "TRUE", "On", " yes\n")],
])
def test_one_truthiness_rule_for_every_switch(name, raw, want):
    assert _read(name, raw) is want


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("raw", [None, "", "  "])
def test_unset_or_empty_is_the_default(name, raw):
    assert _read(name, raw) is SWITCHES[name][1]


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("raw", ["2", "enable", "y", "maybe"])
def test_anything_else_is_a_clear_error(name, raw):
    with pytest.raises(ValueError) as e:
        _read(name, raw)
    msg = str(e.value)
    assert name in msg and repr(raw) in msg
    assert all(w in msg for w in settings.OFF_WORDS + settings.ON_WORDS), msg


def test_the_rule_changes_what_some_values_meant():
    """Each module had its own rule before; one rule now means some values
    changed meaning.  Each case here was the old module's reading."""
    assert _read("FASTDDP_DEBUG", "false") is False  # was on: anything but "" / "0"
    assert _read("FASTDDP_NVTX", "off") is False  # was on: anything but "" / "0"
    assert _read("DDP_SET_LAST_BUCKET_CAP", "no") is False  # was on: anything but "" / "0"
    assert _read("PYTORCH_DDP_USE_SIDE_STREAM", "true") is True  # was off: only "1" was on (torch's test)
    assert _read("PYTORCH_DDP_USE_SIDE_STREAM", "") is True  # was off; empty is now the default
    assert _read("FASTDDP_CHECK_FINITE", "true") == "raise"  # was an error
    assert _read("FASTDDP_CHECK_FINITE", "no") is None  # was an error
    with pytest.raises(ValueError, match="FASTDDP_NATIVE"):
        _read("FASTDDP_NATIVE", "sometimes")  # was on: anything but 0 / false / off / no
    with pytest.raises(ValueError, match="FASTDDP_EXIT_DRAIN_S"):
        _read("FASTDDP_EXIT_DRAIN_S", "soon")  # was the default, 0.5 s, silently
    with pytest.raises(ValueError, match="FASTDDP_EXIT_DRAIN_S"):
        _read("FASTDDP_EXIT_DRAIN_S", "-1")  # was 0
    with pytest.raises(ValueError, match="FASTDDP_CHUNK_BYTES"):
        _read("FASTDDP_CHUNK_BYTES", "-1")  # was off


# ----------------------------------------------------- each other variable
def test_torch_distributed_debug():
    assert _read("TORCH_DISTRIBUTED_DEBUG", None) == "OFF"
    for raw, want in [("detail", "DETAIL"), ("DETAIL", "DETAIL"), ("Info", "INFO"), ("off", "OFF")]:
        assert _read("TORCH_DISTRIBUTED_DEBUG", raw) == want
    with pytest.raises(ValueError, match=r"TORCH_DISTRIBUTED_DEBUG='1'.*OFF, INFO, DETAIL"):
        _read("TORCH_DISTRIBUTED_DEBUG", "1")


def test_debug_mode_is_fastddp_debug_or_torch_detail():
    assert not Settings.from_environment({}).debug_mode
    assert Settings.from_environment({"FASTDDP_DEBUG": "1"}).debug_mode
    assert Settings.from_environment({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).debug_mode
    assert not Settings.from_environment({"TORCH_DISTRIBUTED_DEBUG": "INFO"}).debug_mode


def test_check_finite():
    assert _read("FASTDDP_CHECK_FINITE", None) is None
    for raw, want in [("raise", "raise"), ("RAISE", "raise"), ("warn", "warn"), ("1", "raise"),
                      ("0", None), ("off", None)]:
        assert _read("FASTDDP_CHECK_FINITE", raw) == want
    with pytest.raises(ValueError, match=r"FASTDDP_CHECK_FINITE='loud'.*raise, warn"):
        _read("FASTDDP_CHECK_FINITE", "loud")


def test_native_mode():
    """The semantics fastddp/_native.py implements: on unless off, ``require``
    makes a failed build an error."""
    assert _read("FASTDDP_NATIVE", None) is NativeMode.ON
    assert _read("FASTDDP_NATIVE", "") is NativeMode.ON
    for raw in ("0", "false", "off", "no", "OFF"):
        assert _read("FASTDDP_NATIVE", raw) is NativeMode.OFF
    for raw in ("1", "true", "on", "yes"):
        assert _read("FASTDDP_NATIVE", raw) is NativeMode.ON
    assert _read("FASTDDP_NATIVE", "require") is NativeMode.REQUIRE
    assert _read("FASTDDP_NATIVE", " Require ") is NativeMode.REQUIRE
    with pytest.raises(ValueError, match=r"FASTDDP_NATIVE='need'.*require"):
        _read("FASTDDP_NATIVE", "need")


def test_cxx():
    assert _read("CXX", None) is None
    assert _read("CXX", "") is None  # as before: an empty CXX means "find one on PATH"
    assert _read("CXX", "clang++") == "clang++"
    assert _read("CXX", "/opt/gcc/bin/g++ ") == "/opt/gcc/bin/g++"


def test_chunk_bytes():
    """Unset: None, the mode's own default (fastddp/reduction.py: 1 MiB for
    CPU tensors, unchunked on CUDA); a whole number of bytes, 0 = unchunked."""
    assert _read("FASTDDP_CHUNK_BYTES", None) is None
    assert _read("FASTDDP_CHUNK_BYTES", " ") is None
    assert _read("FASTDDP_CHUNK_BYTES", "0") == 0
    assert _read("FASTDDP_CHUNK_BYTES", "65536") == 65536
    for bad in ("1e6", "1.5", "big", "-4096"):
        with pytest.raises(ValueError, match=rf"FASTDDP_CHUNK_BYTES='{re.escape(bad)}' is not a whole number"):
            _read("FASTDDP_CHUNK_BYTES", bad)


def test_bucket_cap_mb():
    """What fastddp/autotune.py's ``resolve_cap`` reads: ``auto`` or MiB."""
    assert _read("FASTDDP_BUCKET_CAP_MB", None) is None
    assert _read("FASTDDP_BUCKET_CAP_MB", "auto") == "auto"
    assert _read("FASTDDP_BUCKET_CAP_MB", " AUTO ") == "auto"
    assert _read("FASTDDP_BUCKET_CAP_MB", "10") == 10.0
    assert _read("FASTDDP_BUCKET_CAP_MB", "0.5") == 0.5
    for bad in ("nope", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="FASTDDP_BUCKET_CAP_MB"):
            _read("FASTDDP_BUCKET_CAP_MB", bad)


@pytest.mark.parametrize("value", ["auto", "AUTO", "10", "0", 0, 2.5, 25, None, "x", "-1", -1, float("inf"),
                                   True, [1], "nan"])
def test_bucket_cap_parser_equals_autotunes(value):
    """settings.parse_bucket_cap can replace autotune.parse_cap: same values, same errors."""
    from fastddp import autotune

    def outcome(fn):
        try:
            return fn(value, "OPT")
        except (TypeError, ValueError) as e:
            return type(e), str(e)
    assert outcome(settings.parse_bucket_cap) == outcome(autotune.parse_cap)


def test_exit_drain_seconds():
    assert _read("FASTDDP_EXIT_DRAIN_S", None) == 0.5
    assert _read("FASTDDP_EXIT_DRAIN_S", "0") == 0.0
    assert _read("FASTDDP_EXIT_DRAIN_S", "2.5") == 2.5
    for bad in ("soon", "-0.1", "inf", "nan"):
        with pytest.raises(ValueError, match=rf"FASTDDP_EXIT_DRAIN_S='{bad}' is not a number of seconds >= 0"):
            _read("FASTDDP_EXIT_DRAIN_S", bad)


# ----------------------------------------------------------------- read once
def test_read_once_and_reload(env):
    before = env(FASTDDP_NVTX=None)
    assert settings.get() is before and not before.nvtx
    os.environ["FASTDDP_NVTX"] = "1"  # changed behind the snapshot's back: not seen ...
    try:
        assert settings.get() is before and not settings.get().nvtx
        assert settings.reload().nvtx and settings.get().nvtx  # ... until reload()
    finally:
        del os.environ["FASTDDP_NVTX"]
    assert settings.reload() == before


def test_a_bad_value_fails_the_first_read_not_later(env):
    with pytest.raises(ValueError, match="FASTDDP_DEBUG='sure'"):
        env(FASTDDP_DEBUG="sure")
    with pytest.raises(ValueError, match="FASTDDP_DEBUG='sure'"):
        settings.get()  # no snapshot was kept: every read until fixed fails the same way


def test_nothing_is_read_at_import():
    import subprocess
    import sys

    code = ("import os; os.environ['FASTDDP_NVTX'] = 'bad'; import fastddp; "
            "os.environ['FASTDDP_NVTX'] = '1'; from fastddp import settings; print(settings.get().nvtx)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


# ---------------------------------------------------------------- configure
@pytest.fixture
def unconfigured():
    yield
    fastddp.configure(fastddp.Options())


def test_configure_is_where_users_import_it():
    from fastddp import health

    assert fastddp.configure is settings.configure is health.configure
    assert health.configured is settings.configured


def test_configure_check_finite(unconfigured):
    for value, want in [(True, "raise"), ("raise", "raise"), ("warn", "warn"), (False, None), ("off", None)]:
        fastddp.configure(check_finite=value)
        assert settings.parse_check_finite(settings.default("check_finite")) == want
    for bad in ("loud", 1.5, [True]):
        with pytest.raises(ValueError, match=r"fastddp.configure\(check_finite=...\) must be one of"):
            fastddp.configure(check_finite=bad)
    fastddp.configure(check_finite=None)
    assert settings.configured("check_finite") is None


def test_configure_bucket_cap_mb(unconfigured):
    fastddp.configure(bucket_cap_mb="auto")
    assert settings.configured("bucket_cap_mb") == "auto"
    fastddp.configure(bucket_cap_mb=10)
    assert settings.configured("bucket_cap_mb") == 10
    fastddp.configure(check_finite="warn")  # other options leave it alone
    assert settings.configured("bucket_cap_mb") == 10
    with pytest.raises(ValueError, match=r"fastddp.configure\(bucket_cap_mb=...\)"):
        fastddp.configure(bucket_cap_mb="x")
    with pytest.raises(TypeError, match=r"fastddp.configure\(bucket_cap_mb=...\)"):
        fastddp.configure(bucket_cap_mb=True)
    assert settings.configured("bucket_cap_mb") == 10  # a refused value changes nothing
    fastddp.configure(bucket_cap_mb=None)
    assert settings.configured("bucket_cap_mb") is None
    with pytest.raises(TypeError):
        fastddp.configure(10)  # an Options or keywords, nothing else


def test_configure_wins_over_the_environment(env, unconfigured):
    env(FASTDDP_CHECK_FINITE="warn", FASTDDP_BUCKET_CAP_MB="5")
    assert settings.default("check_finite") == "warn" and settings.default("bucket_cap_mb") == 5.0
    fastddp.configure(check_finite=False, bucket_cap_mb="auto")
    # an explicit off (normalised to "off") wins over the environment's "warn"
    assert settings.default("check_finite") == "off" and settings.default("bucket_cap_mb") == "auto"
    assert settings.parse_check_finite(settings.default("check_finite")) is None
    fastddp.configure(check_finite=None, bucket_cap_mb=None)
    assert settings.default("check_finite") == "warn" and settings.default("bucket_cap_mb") == 5.0


# ------------------------------------------------ what a construction reads
def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


@fastddp_only
@pytest.mark.parametrize("values, debug", [
    ({}, False), ({"FASTDDP_DEBUG": "1"}, True), ({"FASTDDP_DEBUG": "false"}, False),
    ({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, True), ({"TORCH_DISTRIBUTED_DEBUG": "INFO"}, False),
])
def test_construction_reads_debug_mode(tmp_path, env, values, debug):
    with single_rank_group(tmp_path):
        env(**values)
        ddp = fastddp.DistributedDataParallel(_model())
        assert ddp.reducer.debug is debug
        assert ddp.stats()["debug"] is debug


@fastddp_only
def test_construction_reads_torchs_switches(tmp_path, env):
    with single_rank_group(tmp_path):
        env(PYTORCH_DDP_USE_SIDE_STREAM=None, DDP_SET_LAST_BUCKET_CAP=None)
        ddp = fastddp.DistributedDataParallel(_model())
        assert ddp.use_side_stream_for_tensor_copies is True
        assert ddp.reducer.opts.bucket.set_last_bucket_as_small is False
        env(PYTORCH_DDP_USE_SIDE_STREAM="0", DDP_SET_LAST_BUCKET_CAP="1")
        ddp = fastddp.DistributedDataParallel(_model())
        assert ddp.use_side_stream_for_tensor_copies is False
        assert ddp.reducer.opts.bucket.set_last_bucket_as_small is True


@fastddp_only
def test_construction_reads_configure_then_the_environment(tmp_path, env, unconfigured):
    with single_rank_group(tmp_path):
        env(FASTDDP_CHECK_FINITE="warn")
        assert fastddp.DistributedDataParallel(_model()).stats()["check_finite"] == "warn"
        fastddp.configure(check_finite="raise")
        assert fastddp.DistributedDataParallel(_model()).stats()["check_finite"] == "raise"
        assert fastddp.DistributedDataParallel(_model(), check_finite=False).stats()["check_finite"] is None


@fastddp_only
def test_a_bad_value_fails_the_construction(tmp_path, env, monkeypatch):
    with single_rank_group(tmp_path):
        monkeypatch.setenv("FASTDDP_NVTX", "maybe")
        with pytest.raises(ValueError, match="FASTDDP_NVTX='maybe'"):
            settings.reload()
        with pytest.raises(ValueError, match="FASTDDP_NVTX='maybe'"):
            fastddp.DistributedDataParallel(_model())


# ------------------------------------------------------------ the options object
def test_options_check_every_field_and_name_it():
    o = fastddp.Options(wire=" Auto-FP8 ", check_finite=True, in_place_numel="AUTO", bucket_cap_mb="10")
    assert (o.wire, o.check_finite, o.in_place_numel, o.bucket_cap_mb) == ("auto-fp8", "raise", "auto", 10.0)
    assert fastddp.Options(check_finite=False).check_finite == "off"  # an explicit off, kept as such
    for kw, match in [({"wire": "fp16"}, r"Options.wire='fp16'; choose one of 'exact'"),
                      ({"ranks_per_host": 0}, "Options.ranks_per_host=0 must be None or a whole number >= 1"),
                      ({"chunk_bytes": -1}, "Options.chunk_bytes=-1"),
                      ({"in_place_numel": "some"}, "Options.in_place_numel='some'"),
                      ({"check_finite": "loud"}, "check_finite must be one of"),
                      ({"bucket_cap_mb": -2}, "bucket_cap_mb must be a finite number")]:
        with pytest.raises(ValueError, match=match):
            fastddp.Options(**kw)
    with pytest.raises(TypeError, match="Options.hierarchical must be True, False or None"):
        fastddp.Options(hierarchical="yes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.wire = "exact"
    # every field has its docstring (the reference users read)
    import ast
    tree = ast.parse(Path(fastddp.options.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Options")
    documented = [a.target.id for a, d in zip(cls.body, cls.body[1:])
                  if isinstance(a, ast.AnnAssign) and isinstance(d, ast.Expr) and isinstance(d.value, ast.Constant)]
    assert documented == [f.name for f in dataclasses.fields(fastddp.Options)]


def test_the_environment_maps_onto_the_options(env, unconfigured):
    env(FASTDDP_AUTO_PRECISION="fp8", FASTDDP_CHUNK_BYTES="4096", FASTDDP_IN_PLACE_NUMEL="0",
        FASTDDP_RANKS_PER_HOST="2", FASTDDP_BUCKET_CAP_MB="auto", FASTDDP_CHECK_FINITE="warn")
    assert settings.effective() == fastddp.Options(wire="auto-fp8", chunk_bytes=4096, in_place_numel=0,
                                                   ranks_per_host=2, bucket_cap_mb="auto", check_finite="warn")
    for raw, wire in [("bf16", "auto"), ("fp32", "auto-fp32"), ("off", None)]:
        env(FASTDDP_AUTO_PRECISION=raw)
        assert settings.effective().wire == wire
    # configure() over the environment, the constructor's over both, field by field
    fastddp.configure(fastddp.Options(chunk_bytes=0, wire="bf16"))
    eff = settings.effective(fastddp.Options(wire="fp8"))
    assert (eff.wire, eff.chunk_bytes, eff.in_place_numel) == ("fp8", 0, 0)
    fastddp.configure(auto_precision="fp8")  # a keyword changes its field alone
    assert settings.effective().wire == "auto-fp8" and settings.effective().chunk_bytes == 0
    assert settings.configured("auto_precision") == "fp8"
    with pytest.raises(TypeError, match="fastddp.configure: takes a fastddp.Options"):
        fastddp.configure({"wire": "fp8"})
    with pytest.raises(TypeError, match="options must be a fastddp.Options"):
        settings.effective({"wire": "fp8"})


@fastddp_only
def test_each_wire_recipe_builds_its_mode(tmp_path, env, unconfigured):
    from fastddp import reduction
    from fastddp.reduction.autoprec import AutoPrecision

    env(FASTDDP_AUTO_PRECISION=None, FASTDDP_IN_PLACE_NUMEL=None, FASTDDP_CHUNK_BYTES=None)
    with single_rank_group(tmp_path):
        def mode(**kw):
            return fastddp.DistributedDataParallel(_model(), options=fastddp.Options(**kw)).reducer.mode

        assert type(mode()).__name__ in ("AllReduce", "AutoPrecision") and mode().kind is reduction.Kind.ALLREDUCE
        assert isinstance(mode(wire="exact", in_place_numel=0), reduction.AllReduce)
        assert mode(wire="exact", in_place_numel=7).in_place_min == 7
        auto = mode(wire="auto-fp8")
        assert isinstance(auto, AutoPrecision) and auto.kind is reduction.Kind.AUTO
        assert list(auto.modes) == ["fp32", "bf16", "fp8"]
        bf16 = mode(wire="bf16", chunk_bytes=4096)
        assert isinstance(bf16, reduction.Fp32Accumulate) and bf16.book.error_feedback
        assert bf16.engine.chunk_bytes == 4096
        fp8 = mode(wire="fp8")
        assert isinstance(fp8, reduction.BlockFp8) and fp8.engine.chunk_bytes is None
        # one host: the hierarchical form runs flat, as the hook does
        assert isinstance(mode(wire="bf16", hierarchical=True), reduction.Fp32Accumulate)
        # configure()'s recipe for code that keeps torch's signature; a registered hook replaces it
        fastddp.configure(fastddp.Options(wire="fp8", chunk_bytes=8192))
        ddp = fastddp.DistributedDataParallel(_model())
        assert isinstance(ddp.reducer.mode, reduction.BlockFp8) and ddp.reducer.mode.engine.chunk_bytes == 8192
        ddp.register_comm_hook(None, fastddp.hooks.fp16_compress_hook)
        assert isinstance(ddp.reducer.mode, reduction.FusedCompression)
        # the constructor's options win over configure()'s
        ddp = fastddp.DistributedDataParallel(_model(), options=fastddp.Options(wire="exact"))
        assert ddp.reducer.mode.kind is reduction.Kind.ALLREDUCE
