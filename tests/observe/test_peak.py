"""The matmul peak: measured once per key, cached as JSON, a corrupt cache measured again (never trusted)."""

import json
import pickle

import pytest
import torch

from relayrl.observe import peak

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_measure(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    calls = []

    def measure(device, dtype, threads):
        calls.append((device, dtype, threads))
        return 100.0 + len(calls)

    monkeypatch.setattr(peak, "measure_gflops", measure)
    return calls


def test_measured_once_then_read_from_the_cache(fake_measure, tmp_path):
    assert peak.matmul_peak("cpu", "float32", 1) == 101.0
    assert peak.matmul_peak("cpu", "float32", 1) == 101.0
    assert fake_measure == [("cpu", "float32", 1)]
    path = tmp_path / "cache" / "matmul_peak.json"
    assert peak.cache_path() == path
    assert json.loads(path.read_text()) == {peak.cache_key("cpu", "float32", 1): 101.0}
    # threads and dtype are part of the key: each is measured on its own, and the first entry stays
    assert peak.matmul_peak("cpu", "float32", 2) == 102.0
    assert peak.matmul_peak("cpu", "bfloat16", 1) == 103.0
    assert len(json.loads(path.read_text())) == 3
    assert peak.matmul_peak("cpu", "float32", 1) == 101.0 and len(fake_measure) == 3


def test_key_names_host_processor_torch_threads_dtype():
    key = peak.cache_key("cpu", "bfloat16", 3)
    # "mm+onednn": the peak is the better of torch's matmul and oneDNN's, so entries timed with torch's alone
    # (before relayrl.models.linear ran oneDNN) are measured again
    assert f"torch {torch.__version__}" in key and "threads 3" in key and key.endswith("bfloat16 | mm+onednn")


def test_the_peak_is_the_fastest_kernel_and_cpu_fp32_times_onednn_too(monkeypatch):
    """measure_gflops takes the fastest of the kernels it times (for the CPU in fp32: torch's mm and oneDNN's linear,
    which relayrl.models.linear runs where it is faster)."""
    import types

    clock = [0.0]  # a clock each fake kernel advances by its own time: a sleep on a loaded machine overshoots

    def kernel(seconds):
        return lambda a, b, out: clock.__setitem__(0, clock[0] + seconds)

    monkeypatch.setattr(peak, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(peak, "_kernels", lambda dev, dt: [kernel(0.05), kernel(0.01)])
    got = peak.measure_gflops("cpu", "float32", 1, reps=2, budget_s=0.0)  # the first size only: n = 256
    assert got == pytest.approx(2 * 256**3 / 0.01 / 1e9)
    monkeypatch.undo()
    names = len(peak._kernels(torch.device("cpu"), torch.float32))
    assert names == (2 if torch.backends.mkldnn.is_available() else 1)
    assert len(peak._kernels(torch.device("cpu"), torch.bfloat16)) == 1


@pytest.mark.parametrize("content", [
    "not json {",
    json.dumps([1, 2]),
    "{}",
])
def test_a_corrupt_or_foreign_file_is_measured_again_and_rewritten(fake_measure, tmp_path, content):
    path = tmp_path / "cache" / "matmul_peak.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert peak.matmul_peak("cpu", "float32", 1) == 101.0
    assert json.loads(path.read_text()) == {peak.cache_key("cpu", "float32", 1): 101.0}


@pytest.mark.parametrize("bad", ["90", -5.0, 0, True, None, float("nan"), float("inf")])
def test_an_entry_that_is_not_a_positive_number_is_measured_again(fake_measure, tmp_path, bad):
    path = tmp_path / "cache" / "matmul_peak.json"
    path.parent.mkdir(parents=True)
    key = peak.cache_key("cpu", "float32", 1)
    path.write_text(json.dumps({key: bad, "other | key": 7.5}))
    assert peak.matmul_peak("cpu", "float32", 1) == 101.0
    assert json.loads(path.read_text()) == {key: 101.0, "other | key": 7.5}  # good entries are kept


def test_a_pickle_is_never_loaded(fake_measure, tmp_path, monkeypatch):
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("the cache was unpickled",))

    path = tmp_path / "cache" / "matmul_peak.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(pickle.dumps(Boom()))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    assert peak.matmul_peak("cpu", "float32", 1) == 101.0


def test_unknown_dtype_is_refused(fake_measure):
    with pytest.raises(ValueError, match="dtype"):
        peak.matmul_peak("cpu", "float16", 1)


def test_the_measurement_is_a_matmul_rate_and_restores_the_threads(monkeypatch):
    monkeypatch.setattr(peak, "CPU_SIZES", (64, 128))
    before = torch.get_num_threads()
    gflops = peak.measure_gflops("cpu", "float32", threads=1, reps=2)
    assert torch.get_num_threads() == before
    # a rate in GFLOP/s (one core reaches tens to ~100), not seconds or FLOPs
    assert 0 < gflops < 1000
