"""The cache directory is data, never code or flags (attnreg/cache.py, docs/errors.md "The
cache directory"): who owns it and who may write it, where attnreg writes, how it writes
(a fresh temporary file renamed over the target; a planted symlink is replaced, never
followed), and what it does with files of the wrong shape (ignored with a CacheWarning that
names them; tuned parameters checked like a caller's params). The Vulkan shim: a planted
library is never handed to the loader."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest

import attnreg
from attnreg import cache, tuned, vkshim
from tests.support import missing

SPEC = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=1023, num_heads=4, kv_num_heads=2,
                             head_size=16)
ENTRY = {"kernel": "reference.decode_partial", "params": {"split_size": 256}, "us": 1.0,
         "rule_default_us": 2.0}


@pytest.fixture
def cdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ATTNREG_CACHE_DIR of this test's own (mode 0700), adopted by attnreg (its tag)."""
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(cache.ENV, str(d))
    cache.directory(create=True)
    return d


def _caps() -> attnreg.DeviceCaps:
    return attnreg.devices("reference")[0]


def _tuned_split(**flags: object) -> int:
    plan = attnreg.explain(SPEC, backend="reference", flags={"use_tuning_cache": True, **flags})
    return int(plan.params["split_size"])


# -- who owns it, where attnreg writes --------------------------------------------------------
def test_a_directory_others_may_write_is_refused(cdir: Path) -> None:
    os.chmod(cdir, 0o777)
    for call in (lambda: tuned.store(_caps(), "decode_partial", SPEC, ENTRY), tuned.load,
                 lambda: _tuned_split()):
        with pytest.raises(attnreg.SpecError, match="not writable by group or others") as info:
            call()
        assert info.value.field == cache.ENV
    assert [p.name for p in cdir.iterdir()] == [cache.TAG]


def test_a_directory_of_another_user_is_refused(cdir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    os.chown(cdir, 1, 1)
    with pytest.raises(attnreg.SpecError, match="owned by you") as info:
        tuned.store(_caps(), "decode_partial", SPEC, ENTRY)
    assert info.value.field == cache.ENV


def test_attnreg_writes_only_where_it_is_its_own(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTNREG_CACHE_DIR=/etc as root wrote /etc/cl_optimizer.json: a directory holding other
    files and no CACHEDIR.TAG of attnreg's is refused; a new one is made 0700 with the tag;
    an empty one is adopted; a relative path is refused."""
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    (etc / "passwd").write_text("root:x:0:0\n")
    monkeypatch.setenv(cache.ENV, str(etc))
    with pytest.raises(attnreg.SpecError, match="own") as info:
        tuned.store(_caps(), "decode_partial", SPEC, ENTRY)
    assert info.value.field == cache.ENV and sorted(os.listdir(etc)) == ["passwd"]
    new = tmp_path / "new" / "cache"
    monkeypatch.setenv(cache.ENV, str(new))
    tuned.store(_caps(), "decode_partial", SPEC, ENTRY)
    assert (new.stat().st_mode & 0o777) == 0o700 and (new / cache.TAG).is_file()
    assert sorted(os.listdir(new)) == [cache.TAG, "tuning.json"]
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    monkeypatch.setenv(cache.ENV, str(empty))
    tuned.store(_caps(), "decode_partial", SPEC, ENTRY)
    assert (empty / cache.TAG).is_file()
    monkeypatch.setenv(cache.ENV, "relative/cache")
    with pytest.raises(attnreg.SpecError, match="absolute"):
        tuned.load()


# -- how it writes ----------------------------------------------------------------------------
def test_writes_replace_a_planted_symlink_and_never_follow_it(cdir: Path, tmp_path: Path) -> None:
    """tuned.store wrote through a fixed tuning.tmp: a symlink planted there (or at the target)
    overwrote the file it pointed to."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for planted in ("tuning.json", "tuning.tmp", ".tuning.json.tmp"):
        os.symlink(victim, cdir / planted)
    with pytest.warns(attnreg.CacheWarning, match="tuning.json"):      # the symlink: ignored
        tuned.store(_caps(), "decode_partial", SPEC, ENTRY)
    assert victim.read_text() == "precious\n"
    assert not (cdir / "tuning.json").is_symlink()
    assert json.loads((cdir / "tuning.json").read_text())
    leftovers = [p.name for p in cdir.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
    assert leftovers == []


# -- what it reads ----------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "[1, 2, 3]",                                                   # valid JSON, wrong shape
    '{"a": {"b": {"kernel": 5}}}',
    "not json at all",
])
def test_files_of_the_wrong_shape_are_ignored_with_a_warning_naming_them(cdir: Path,
                                                                          text: str) -> None:
    (cdir / "tuning.json").write_text(text)
    os.chmod(cdir / "tuning.json", 0o600)
    with pytest.warns(attnreg.CacheWarning, match=str(cdir / "tuning.json")):
        assert tuned.load() == {}
    with pytest.warns(attnreg.CacheWarning):
        plain = attnreg.explain(SPEC, backend="reference").params["split_size"]
        assert _tuned_split() == plain


@pytest.mark.parametrize("params", [{"kv_tile": 0}, {"split_size": "x"}, {"split_size": -5},
                                    {"split_size": 2**40}, {"no_such": 1}])
def test_tuned_parameters_pass_the_checks_of_params(cdir: Path, params: dict) -> None:
    """kv_tile 0 was a ZeroDivisionError, split_size "x" a ValueError, -5 silently 1."""
    tuned.store(_caps(), "decode_partial", SPEC, {**ENTRY, "params": params})
    plain = attnreg.explain(SPEC, backend="reference").params["split_size"]
    with pytest.warns(attnreg.CacheWarning, match="tuning cache"):
        assert _tuned_split() == plain
    tuned.store(_caps(), "decode_partial", SPEC, ENTRY)                 # a good entry: used
    assert _tuned_split() == 256


def test_files_others_may_write_or_own_are_ignored(cdir: Path) -> None:
    tuned.store(_caps(), "decode_partial", SPEC, ENTRY)
    os.chmod(cdir / "tuning.json", 0o666)
    with pytest.warns(attnreg.CacheWarning, match="writable by group or others"):
        assert tuned.load() == {}


# -- the Vulkan shim: a planted library is never loaded ---------------------------------------
def test_a_planted_shim_library_is_rebuilt_never_loaded(cdir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A library planted at $ATTNREG_CACHE_DIR/vkshim/<key>/libattnreg_vkshim.so was handed to
    the Vulkan loader (in the probe's child and in the process). Now the manifest is used only
    when the library's bytes match the SHA-256 recorded when attnreg built it: a planted one
    (with or without a forged manifest) is rebuilt, or without a compiler not used at all."""
    if vkshim.lavapipe_manifest() is None:
        missing("no lavapipe on this machine (the shim is for it)")
    monkeypatch.delenv(vkshim.ENV, raising=False)
    for v in vkshim.LOADER_VARS:
        monkeypatch.delenv(v, raising=False)
    out = vkshim.build().parent
    good = (out / vkshim.LIBRARY).read_bytes()
    planted = b"\x7fELF planted by someone else"
    (out / vkshim.LIBRARY).write_bytes(planted)
    rebuilt = vkshim.manifest()
    assert rebuilt is not None
    assert (out / vkshim.LIBRARY).read_bytes() == good
    assert hashlib.sha256(good).hexdigest() == (out / vkshim.RECORD).read_text().strip()
    # planted again, no compiler to rebuild it: no shim at all
    (out / vkshim.LIBRARY).write_bytes(planted)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert vkshim.manifest() is None
    assert vkshim.driver_files() is None
    # a manifest naming another library, with a matching record: not attnreg's, not used
    monkeypatch.delenv("CC")
    vkshim.build(force=True)
    other = cdir / "evil.so"
    other.write_bytes(planted)
    man = json.loads((out / vkshim.MANIFEST).read_text())
    man["ICD"]["library_path"] = str(other)
    (out / vkshim.MANIFEST).write_text(json.dumps(man))
    assert not vkshim.verified(out)
    got = vkshim.manifest()
    assert got is not None and json.loads(Path(got).read_text())["ICD"]["library_path"] == \
        str(out / vkshim.LIBRARY)


def test_reading_the_cache_never_warns_on_a_clean_one(cdir: Path) -> None:
    tuned.store(_caps(), "decode_partial", SPEC, ENTRY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _tuned_split() == 256
