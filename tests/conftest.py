"""Session fixtures shared by the training tests."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

# Imported once here so that every forked rank of every test starts with them loaded (datasets
# alone takes ~2 s to import). The GPU machine has no `datasets`; its tests need neither.
try:
    import datasets  # noqa: F401
except ImportError:  # pragma: no cover - only where datasets is not installed
    pass
import engine.train.trainer  # noqa: F401,E402

from engine.testing.processes import run_distributed
from tests.training_utils import MAX_NORM, REPO, SMALL_CORPUS, base_args, clipping_sides, train_and_record


class _TextBatches:
    """What engine/data/builders.py's ``iter_text_batches`` returns under :func:`_share_packed_corpora`:
    the same batches, and the dataset and column they come from (the key of the packed stream)."""

    def __init__(self, real, ds, column: str, batch_size: int, **kwargs):
        self.real, self.ds, self.column, self.batch_size, self.kwargs = real, ds, column, batch_size, kwargs

    def __iter__(self):
        return iter(self.real(self.ds, self.column, batch_size=self.batch_size, **self.kwargs))


def _share_packed_corpora() -> None:
    """Read and tokenize each local corpus file once per test process, not once per training run.

    Most tests train many runs (layouts, ranks, resumes) on the same small file with the same
    tokenizer; engine/data/builders.py reads it with ``load_documents`` (datasets) and tokenizes it
    with ``pack_documents`` each time: a quarter of a forked two-rank run's time. Both are pure
    functions of the file's bytes, the text column and the tokenizer file, so their results are kept
    here, keyed by those (path, size and modification time of both files): a file that a test
    rewrites or damages is read again. Every window, shuffle and dp split is still computed per run.
    The cache fills in this pytest process and every forked rank inherits it; a corpus first seen
    inside a rank is cached in that rank only. ``QUADRA_TEST_READ_EVERY_RUN=1`` turns it off.
    """
    if os.environ.get("QUADRA_TEST_READ_EVERY_RUN") == "1" or importlib.util.find_spec("datasets") is None:
        return  # (the GPU machine has no `datasets`; its tests read no corpus)
    import engine.data.builders as loader

    real_load, real_iter, real_pack = loader.load_documents, loader.iter_text_batches, loader.pack_documents
    loaded: dict = {}
    packed: dict = {}

    def stamp(path: str) -> tuple:
        st = os.stat(path)
        return os.path.realpath(path), st.st_size, st.st_mtime_ns

    def load_documents(path, **kwargs):
        if kwargs.get("streaming") or not os.path.isfile(path):
            return real_load(path, **kwargs)
        # A local file is one split whatever `split` says; the setting names only go into errors.
        key = (stamp(path), kwargs.get("text_column", "text"))
        if key not in loaded:
            loaded[key] = real_load(path, **kwargs)
        return loaded[key]

    def iter_text_batches(ds, column, batch_size=256, **kwargs):
        return _TextBatches(real_iter, ds, column, batch_size, **kwargs)

    def pack_documents(text_batches, tokenizer):
        ds = getattr(text_batches, "ds", None)
        if not any(ds is value for value in loaded.values()) or not os.path.isfile(tokenizer.path):
            return real_pack(text_batches, tokenizer)
        key = (id(ds), text_batches.column, stamp(tokenizer.path))
        if key not in packed:
            packed[key] = real_pack(text_batches, tokenizer)
        return packed[key]

    loader.load_documents, loader.iter_text_batches, loader.pack_documents = load_documents, iter_text_batches, pack_documents
    # The suite's corpus and tokenizer, read here so that every forked rank starts with them.
    from engine.data.tokenizer import Tokenizer

    corpus = load_documents(SMALL_CORPUS, text_column="text")
    pack_documents(iter_text_batches(corpus, "text"), Tokenizer(os.path.join(REPO, "assets", "tokenizer", "shakespeare.model")))


_share_packed_corpora()


TEST_TIMEOUT_S = float(os.environ.get("QUADRA_TEST_TIMEOUT", "900"))


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _time_out(item, seconds: float) -> None:
    """One test (with its fixtures) ran over ``seconds``: say which, dump every thread's stack, kill the
    processes it started and end this pytest process (under xdist the worker is reported crashed on
    that test and replaced, so the rest of the suite still runs)."""
    import faulthandler
    import signal
    import sys

    try:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # fd 2 back to the terminal, as pytest-timeout's thread method does
            capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\nquadra tests: {item.nodeid} ran over {seconds:.0f} s (QUADRA_TEST_TIMEOUT); the "
                         "stacks of this process follow, its child processes are killed\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)  # to fd 2
    finally:
        try:
            for pid in _descendants(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        finally:
            os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """No test hangs the suite: a test whose set-up, call and tear-down run over QUADRA_TEST_TIMEOUT
    seconds (default 900; 0: no limit) ends the run of its process with its name and every thread's
    stack (pytest-timeout's method, without the dependency). A watchdog thread of Python's own
    ``threading.Timer`` does it; faulthandler's C-level one (``dump_traceback_later``, which needs no
    GIL) ends the process a minute later if the GIL is never released."""
    if TEST_TIMEOUT_S <= 0:
        yield
        return
    import faulthandler
    import threading

    timer = threading.Timer(TEST_TIMEOUT_S, _time_out, (item, TEST_TIMEOUT_S))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S + 60, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _alone_when_timed(request):
    """Under scripts/test.sh's two pytest-xdist workers, a test marked ``timing`` (it asserts on
    measured times: the pipeline bubble, the step's time split) runs while the other worker waits, so
    that the second worker's processes do not inflate what it measures; the other tests share.

    A fair readers-writer lock on two files (flock(2), released by the kernel if a worker dies): every
    test passes a turnstile, then holds the room shared (a timed test: exclusive); a timed test keeps
    the turnstile while it waits for the room, so the other worker cannot start another test and
    starve it. Without xdist there is nothing to wait for.
    """
    uid = getattr(request.config, "workerinput", {}).get("testrunuid")
    if uid is None:
        yield
        return
    import fcntl
    import tempfile

    base = os.path.join(tempfile.gettempdir(), f"quadra-tests-{uid}")
    timed = request.node.get_closest_marker("timing") is not None
    with open(base + ".turnstile", "a") as turnstile, open(base + ".room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if timed else fcntl.LOCK_SH)
        if not timed:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    """Run tests/integration/ first (multi-process training, runs through ./run_train.sh), then
    tests/unit/, then the files that hold a test marked ``timing``, tests/integration/test_gpu.py last.
    GPU last: the other tests fork CPU workers, which must not start from a process that has
    initialized CUDA (a forked child cannot use it, and may fail touching it). Integration first: the
    two workers of scripts/test.sh take whole files in this order, so the long ones start early and the
    short ones fill the end instead of one worker finishing a long file while the other idles. Timed
    files after those: a timed test waits for the other worker's test in progress (:func:`_alone_when_timed`),
    which among the integration files was often one of a minute or more (test_attribution.py's 5 s test
    waited 101 s in a full run), and keeps the other worker waiting while it runs; at the end the other
    worker has a unit test in progress or nothing left (those files: test_attribution.py,
    test_pipeline_timed.py, test_recovery_timed.py)."""
    timed = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("timing") is not None}
    items.sort(key=lambda item: (item.nodeid.startswith("tests/integration/test_gpu.py"),
                                 item.nodeid.split("::")[0] in timed,
                                 not item.nodeid.startswith("tests/integration/")))


def _warm_compile() -> None:
    """One aot_eager compile of the suite's model in this process, forgotten at once
    (``torch._dynamo.reset()``), so that every rank forked after it starts with what a first compile
    loads lazily: ~570 modules (torch._inductor's lowering and codegen, torch._export, networkx,
    jinja2, ...) and Dynamo's tables, ~2 s of CPU in every rank of a compiled layout, 16 at once in
    tests/integration/test_context_parallel.py's 4-D mesh. The global RNG is left as it was."""
    import torch

    from models import get_model_args, get_model_spec
    from models.registry import load_ref
    from parallelisms.compile import compiled_modules
    from tests.training_utils import FLAVOR

    with torch.random.fork_rng(devices=[]):
        args = get_model_args("llama", FLAVOR)
        model = load_ref(get_model_spec("llama").model_cls)(args)
        model.init_weights(seed=0)
        for module in compiled_modules(model):
            module.compile(backend="aot_eager", fullgraph=True)
        tokens = torch.randint(0, args.vocab_size, (1, 16))
        model(tokens).float().logsumexp(-1).sum().backward()
        with torch.no_grad():  # the recompile every validation takes
            model(tokens)
    torch._dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def _compile_warmed(request):
    """:func:`_warm_compile` once per test process where tests/integration/ runs (its parity layouts
    compile in forked ranks); a run of tests/unit/ alone does not pay for it (~2 s)."""
    if any(item.nodeid.startswith("tests/integration/") for item in request.session.items):
        _warm_compile()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """[(loss, grad_norm)] of the 5-step single-process run (no process group, one microbatch of 8)."""
    folder = tmp_path_factory.mktemp("single")
    (history,) = run_distributed(train_and_record, 1, base_args(str(folder)), torchrun_env=False)
    # Over 5 steps of 32-token batches the batch-to-batch spread of the loss exceeds the progress, so
    # "it learns" is not checked here: tests/integration/test_reference_loop.py checks this run step by step
    # against a plain PyTorch loop instead.
    assert len(history) == 5 and all(math.isfinite(loss) for loss, _ in history), history
    # Every layout compared with this run must have steps on both sides of the clipping threshold:
    # clipped (a wrong clip changes the next loss) and not clipped (a clip that scaled gradients up
    # would too), each at least CLIP_MARGIN away from MAX_NORM.
    above, below = clipping_sides(history)
    assert above >= 1 and below >= 1, f"max_norm {MAX_NORM} is not between the steps' norms: {history}"
    # Validation after steps 2, 4 and at the end (5), as the default config would.
    assert [step for step, _ in history.validation] == [2, 4, 5], history.validation
    return history


@pytest.fixture(scope="module")
def private_datasets_cache(tmp_path_factory):
    """Keep the corpora a test module writes out of the user's ~/.cache (datasets caches them)."""
    # Imported here: tests/integration/test_gpu.py runs where `datasets` is not installed (the GPU machine).
    import datasets

    old = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_cache"))
    yield
    datasets.config.HF_DATASETS_CACHE = old


@pytest.fixture(scope="module")
def tok():
    """The bundled Shakespeare tokenizer (vocab 4096)."""
    from engine.data.tokenizer import Tokenizer

    return Tokenizer(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                  "tokenizer", "shakespeare.model"))
