"""The kill-and-resume harness and its crash points, on real processes killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from durable_sessions import crash
from durable_sessions.cli import main
from durable_sessions.harness import Trial, describe, prove
from durable_sessions.journal import SqliteJournal
from durable_sessions.otlp_json import spans_of

ROOT = Path(__file__).resolve().parents[1]
TRIP = [sys.executable, str(ROOT / "examples" / "agents" / "resumable_trip.py")]


def world(trial: Path) -> list[dict]:
    path = trial / "world.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_resumable_agent_comes_back_at_every_crash_point(tmp_path: Path) -> None:
    proof = prove(TRIP, tmp_path)
    assert proof.passed, "\n".join(describe(proof))
    assert len(proof.reference.completed) == 5
    assert [t.name for t in proof.trials] == [f"{p}-{n}" for n in range(1, 6) for p in ("before", "after")]
    for trial in proof.trials:
        assert [run.returncode for run in trial.runs] == [-signal.SIGKILL, 0]
        events = world(trial.directory)
        assert sum(e["event"] == "charge" for e in events) == 1, (
            trial.name
        )  # charged once, whatever the crash
        assert sum(e["event"] == "email" for e in events) >= 1
    # Killed after asking, before the answer was journaled, the person is asked again:
    # the answer existed only in the dead process. Killed later, never.
    asks = {t.name: sum(e["event"] == "asked" for e in world(t.directory)) for t in proof.trials}
    assert asks.pop("after-1") == 2 and set(asks.values()) == {1}
    # ... and the trace says so: the question's span in the resumed run is its second attempt.
    (asked_again,) = [
        span.attributes
        for line in (proof.trials[1].directory / "traces.jsonl").read_text().splitlines()
        for span in spans_of(json.loads(line))
        if span.attributes["agent.action.id"] == "a01"
    ]
    assert asked_again["agent.action.attempts"] == 2


def test_an_agent_without_a_journal_is_caught_asking_again(tmp_path: Path) -> None:
    proof = prove([*TRIP, "--no-journal"], tmp_path, points=("before",))
    assert not proof.passed
    failed = {t.name: {v.rule for v in t.errors} for t in proof.trials if not t.passed}
    assert failed["before-2"] == {"re-asked"}
    assert {"re-asked", "diverged-result"} <= failed["before-4"]
    assert "before-1" not in failed  # killed before anything was recorded: nothing to replay


def test_an_unkeyed_payment_in_doubt_stops_the_resumed_run(tmp_path: Path) -> None:
    proof = prove([*TRIP, "--unkeyed"], tmp_path, points=("after",))
    after_payment = next(t for t in proof.trials if t.name == "after-4")
    assert after_payment.runs[-1].returncode == 1
    assert "ActionInDoubt" in after_payment.problems[0]
    assert "unresolved-side-effect" in {v.rule for v in after_payment.errors}
    assert sum(e["event"] == "charge" for e in world(after_payment.directory)) == 1  # not charged twice
    assert any("did not come back where it was" in p and "a04" in p for p in after_payment.problems)
    # Killed after the last action: the resumed run replays the payment, which did not
    # execute again, so the unkeyed payment is reported once, on the run that made it.
    after_all = next(t for t in proof.trials if t.name == "after-5")
    unkeyed = [v for v in after_all.errors if v.rule == "unkeyed-side-effect"]
    assert [v.action_id for v in unkeyed] == ["a04"]


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_a_failing_reference_run_ends_the_proof(tmp_path: Path) -> None:
    proof = prove(_script(tmp_path, "import sys; print('no config'); sys.exit(3)"), tmp_path / "p")
    assert proof.trials == []
    assert proof.reference.problems == ["the reference run exited 3; it printed:\nno config"]


def test_an_agent_that_writes_no_spans_is_told_how(tmp_path: Path) -> None:
    agent = _script(
        tmp_path,
        f"""
        import sys
        sys.path.insert(0, {str(ROOT / "src")!r})
        from durable_sessions.instrument import action, session
        with session("s-1"):
            action("a1", "clock")(lambda: 1)()
        """,
    )
    proof = prove(agent, tmp_path / "p")
    assert "no spans were written to" in proof.reference.problems[0]
    assert "FileSpanExporter" in proof.reference.problems[0]
    assert proof.boundaries == 1  # counted even so


def test_spans_on_a_provider_the_actions_do_not_use_are_pointed_out(tmp_path: Path) -> None:
    """The exporter built (so the file exists) but its provider never made the global one."""
    agent = _script(
        tmp_path,
        f"""
        import os, sys
        sys.path.insert(0, {str(ROOT / "src")!r})
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from durable_sessions.instrument import action, session
        from durable_sessions.otlp_json import FileSpanExporter
        TracerProvider().add_span_processor(SimpleSpanProcessor(FileSpanExporter(os.environ["DURABLE_SESSIONS_TRACES"])))
        with session("s-1"):
            action("a1", "clock")(lambda: 1)()
        """,
    )
    proof = prove(agent, tmp_path / "p")
    assert not proof.passed and proof.trials == []
    assert "holds none of them" in proof.reference.problems[0]
    assert "trace.set_tracer_provider(provider)" in proof.reference.problems[0]


def test_a_hanging_run_is_stopped_at_the_timeout(tmp_path: Path) -> None:
    proof = prove(_script(tmp_path, "import time; time.sleep(60)"), tmp_path / "p", timeout_s=0.5)
    assert proof.reference.runs[0].returncode is None
    assert "did not finish within" in proof.reference.problems[0]


def test_placeholders_and_environment_name_the_trial_state(tmp_path: Path) -> None:
    agent = _script(
        tmp_path,
        """
        import json, os, sys
        json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": {k: v for k, v in os.environ.items()
                   if k.startswith("DURABLE_SESSIONS_")}}, open(os.path.join(sys.argv[3], "seen.json"), "w"))
        """,
    )
    prove([*agent, "{journal}", "{traces}", "{dir}"], tmp_path / "p")
    seen = json.loads((tmp_path / "p" / "reference" / "seen.json").read_text())
    reference = tmp_path / "p" / "reference"
    expected = [str(reference / "journal.db"), str(reference / "traces.jsonl"), str(reference)]
    assert seen["argv"] == expected
    assert [seen["env"][f"DURABLE_SESSIONS_{k}"] for k in ("JOURNAL", "TRACES", "DIR")] == expected
    assert crash.ENV not in seen["env"]
    assert seen["cwd"] == os.getcwd()  # relative paths in the command mean what they say


def test_the_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prove", "--dir", str(tmp_path / "ok"), "--points", "after", "--", *TRIP]) == 0
    assert "5 crash points: 5 resumed, 0 failed" in capsys.readouterr().out
    assert (
        main(["prove", "--dir", str(tmp_path / "bad"), "--format", "json", "--", *TRIP, "--no-journal"]) == 1
    )
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False and document["reference"]["passed"] is True
    assert main(["prove", "--dir", str(tmp_path / "ok"), "--", *TRIP]) == 2
    assert "exists already" in capsys.readouterr().err
    assert main(["prove"]) == 2
    assert "give the agent's command after --" in capsys.readouterr().err
    assert main(["prove", "--dir", str(tmp_path / "none"), "--", str(tmp_path / "no-such-agent")]) == 2
    assert "could not start" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["prove", "--points", "middle", "--", "true"])
    assert exit_info.value.code == 2
    assert "'middle' is not a crash point" in capsys.readouterr().err


def test_a_crash_point_kills_the_process_and_leaves_the_intent(tmp_path: Path) -> None:
    agent = _script(
        tmp_path,
        f"""
        import sys
        sys.path.insert(0, {str(ROOT / "src")!r})
        from durable_sessions.instrument import action, session
        from durable_sessions.journal import SqliteJournal
        with session("s-1", journal=SqliteJournal("journal.db")):
            for n in range(3):
                action(f"p{{n}}", "payment", idempotency_key=f"k{{n}}")(lambda: print("paid", flush=True))()
        """,
    )
    env = {**os.environ, crash.ENV: "after:2"}
    done = subprocess.run(agent, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.count("paid") == 2  # the second payment ran, then the process died
    journal = SqliteJournal(tmp_path / "journal.db")
    assert [(e.action_id, e.status) for e in journal.entries("s-1")] == [("p0", "ok"), ("p1", "started")]


@pytest.mark.parametrize("value", ["after", "during:1", "before:0", "before:x"])
def test_a_bad_crash_point_setting_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match=crash.ENV):
        crash.parse(value)


def _fixed_journal_agent(tmp_path: Path) -> list[str]:
    """An agent of two actions whose journal is one fixed file, whichever run it is."""
    return _instrumented(
        tmp_path,
        f"""
        journal = SqliteJournal({str(tmp_path / "fixed.db")!r})
        with session("s-1", journal=journal):
            action("a1", "clock")(lambda: 1)()
            action("a2", "clock")(lambda: 2)()
        """,
    )


def _instrumented(tmp_path: Path, body: str) -> list[str]:
    """An agent script with a journal and the file exporter, ``body`` run in its session."""
    header = f"""
        import os, sys
        sys.path.insert(0, {str(ROOT / "src")!r})
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from durable_sessions.instrument import action, resource, session
        from durable_sessions.journal import SqliteJournal
        from durable_sessions.otlp_json import FileSpanExporter
        provider = TracerProvider(resource=resource())
        provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(os.environ["DURABLE_SESSIONS_TRACES"])))
        trace.set_tracer_provider(provider)
        journal = SqliteJournal(os.environ["DURABLE_SESSIONS_JOURNAL"])
    """
    return _script(tmp_path, textwrap.dedent(header) + textwrap.dedent(body))


def test_an_outer_action_has_its_own_after_boundary(tmp_path: Path) -> None:
    """``after:1`` of an action that runs another inside it kills after the outer body."""
    agent = _instrumented(
        tmp_path,
        """
        with session("s-1", journal=journal):
            with action("outer", "tool_call") as outer:
                action("inner", "clock")(lambda: 1)()
                print("outer body done", flush=True)
                outer.record(2)
            print("after outer", flush=True)
        """,
    )
    done = subprocess.run(
        agent,
        env={
            **os.environ,
            crash.ENV: "after:1",
            "DURABLE_SESSIONS_TRACES": str(tmp_path / "t.jsonl"),
            "DURABLE_SESSIONS_JOURNAL": str(tmp_path / "j.db"),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL and done.stdout == "outer body done\n"
    assert SqliteJournal(tmp_path / "j.db").get("s-1", "outer").status == "started"


def test_every_boundary_is_tested_when_an_action_fails(tmp_path: Path) -> None:
    """With ``after`` only, a failing action's boundary is not reached; the later ones still are."""
    agent = _instrumented(
        tmp_path,
        """
        with session("s-1", journal=journal):
            action("a1", "clock")(lambda: 1)()
            try:
                action("a2", "tool_call")(lambda: 1 / 0)()
            except ZeroDivisionError:
                pass
            action("a3", "clock")(lambda: 3)()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("after",))
    assert proof.boundaries == 3
    assert [(t.name, t.reached) for t in proof.trials] == [
        ("after-1", True),
        ("after-2", False),
        ("after-3", True),
    ]


def test_a_proof_of_nothing_does_not_pass(tmp_path: Path) -> None:
    agent = _instrumented(tmp_path, "open(os.environ['DURABLE_SESSIONS_TRACES'], 'w').close()")
    proof = prove(agent, tmp_path / "p")
    assert not proof.passed
    assert "ran no action" in proof.reference.problems[0]


def test_a_cut_short_proof_says_so(tmp_path: Path) -> None:
    proof = prove(TRIP, tmp_path, max_boundaries=2, points=("before",))
    assert (proof.boundaries, proof.tested, len(proof.trials)) == (5, 2, 2)
    assert "only the first 2 of 5 actions were tested" in list(describe(proof))[-1]


def test_a_launcher_goes_down_with_the_agent(tmp_path: Path) -> None:
    """The crash takes the run's process group: a shell that does not exec the agent, and
    would run on after it, is killed with it."""
    launcher = ["sh", "-c", f"{sys.executable} {TRIP[1]}; echo agent gone"]
    proof = prove(launcher, tmp_path, points=("after",), max_boundaries=2)
    assert proof.passed, "\n".join(describe(proof))
    assert all(t.runs[0].killed_at_crash_point for t in proof.trials)
    assert "agent gone" not in (proof.trials[0].directory / "run-1.log").read_text()


def test_an_exit_status_of_137_counts_as_the_kill() -> None:
    from durable_sessions.harness import Run

    assert Run(137, 0.1, "").killed_at_crash_point and Run(-9, 0.1, "").killed_at_crash_point
    assert not Run(1, 0.1, "").killed_at_crash_point


def test_a_helper_process_left_holding_the_output_neither_delays_nor_outlives_the_run(tmp_path: Path) -> None:
    agent = _instrumented(
        tmp_path,
        """
        import subprocess
        helper = subprocess.Popen(["sleep", "1000"])  # inherits standard output, as a stdio server would
        open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "helper.pid"), "w").write(str(helper.pid))
        with session("s-1", journal=journal):
            action("a1", "clock")(lambda: 1)()
        helper.kill()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("before",), timeout_s=30)
    (trial,) = proof.trials
    assert trial.runs[0].killed_at_crash_point and trial.runs[0].seconds < 20
    pid = int((trial.directory / "helper.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_relative_paths_mean_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    relative_dir = os.path.relpath(tmp_path / "p", ROOT)
    agent = [sys.executable, "examples/agents/resumable_trip.py"]
    assert (
        main(["prove", "--dir", relative_dir, "--points", "before", "--max-actions", "1", "--", *agent]) == 0
    )
    assert (tmp_path / "p" / "before-1" / "journal.db").exists()


def test_a_journal_shared_by_every_trial_is_no_proof(tmp_path: Path) -> None:
    """A fixed journal path: every later run replays everything, is never killed, and that fails."""
    agent = _fixed_journal_agent(tmp_path)
    proof = prove(agent, tmp_path / "p", points=("before",))
    assert not proof.passed
    assert all("was not killed at before action" in t.problems[0] for t in proof.trials)
    assert "{journal}" in proof.trials[0].problems[0]


def test_actions_in_worker_processes_are_numbered_as_the_reference_counted_them(tmp_path: Path) -> None:
    agent = _instrumented(
        tmp_path,
        """
        import multiprocessing

        def work(n):
            with session("s-1", journal=journal):
                action(f"w{n}", "llm_call")(lambda: n)()

        if __name__ == "__main__":
            with session("s-1", journal=journal):
                action("first", "clock")(lambda: 0)()
            for n in (1, 2):
                worker = multiprocessing.get_context("spawn").Process(target=work, args=(n,))
                worker.start()
                worker.join()
                if worker.exitcode:
                    os.kill(os.getpid(), 9)  # a worker killed at its crash point: the agent dies with it
            with session("s-1", journal=journal):
                action("last", "clock")(lambda: 3)()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("before",))
    assert proof.boundaries == 4
    assert proof.passed, "\n".join(describe(proof))
    assert len(proof.trials) == 4 and all(t.runs[0].killed_at_crash_point for t in proof.trials)


def test_actions_without_a_session_make_the_reference_unusable(tmp_path: Path) -> None:
    agent = _instrumented(
        tmp_path,
        """
        from concurrent.futures import ThreadPoolExecutor
        with session("s-1", journal=journal), ThreadPoolExecutor(1) as pool:
            pool.submit(action("ask", "user_prompt")(lambda: "yes")).result()  # the context is not copied
        """,
    )
    proof = prove(agent, tmp_path / "p")
    assert proof.trials == []
    assert "actions ran without a session id (ask)" in proof.reference.problems[0]
    # Nothing was cut short by --max-actions: the reference stopped the proof (a review
    # found the note blaming --max-actions on a refused reference).
    assert list(describe(proof))[-1] == "0 crash points: 0 resumed, 0 failed; the reference run failed"


def test_a_crash_in_a_worker_process_takes_the_whole_agent(tmp_path: Path) -> None:
    """A pool worker killed at its crash point would leave the pool waiting for ever: the
    crash takes the run's whole process group, as a machine going down would."""
    agent = _instrumented(
        tmp_path,
        """
        import multiprocessing

        def work(n):
            with session("s-1", journal=journal):
                return action(f"w{n}", "llm_call")(lambda: n)()

        if __name__ == "__main__":
            with session("s-1", journal=journal):
                action("first", "clock")(lambda: 0)()
            with multiprocessing.get_context("fork").Pool(1) as pool:
                print(pool.map(work, [1, 2]))
        """,
    )
    proof = prove(agent, tmp_path / "p", timeout_s=30)
    assert proof.boundaries == 3
    assert proof.passed, "\n".join(describe(proof))
    assert all(t.runs[0].killed_at_crash_point and t.runs[0].seconds < 20 for t in proof.trials)


def test_a_payment_resumed_under_a_key_made_afresh_fails_the_proof(tmp_path: Path) -> None:
    """The reviewer's agent: a uuid4 key per process, the payment last. The resumed run
    charged again under its new key and the proof passed; now the journal's key stands
    and the resumed run stops in doubt, naming both keys."""
    agent = _instrumented(
        tmp_path,
        """
        import json, uuid
        KEY = "order-7-" + uuid.uuid4().hex  # not stable across restarts

        @action("a01", "llm_call")
        def quote():
            return 120

        @action("a02", "payment", idempotency_key=KEY)
        def pay(amount):
            with open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "world.jsonl"), "a") as world:
                world.write(json.dumps({"event": "charge", "key": KEY}) + "\\n")
            return {"charged": amount}

        with session("order-7", journal=journal):
            pay(quote())
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("after",))
    assert not proof.passed
    after_payment = next(t for t in proof.trials if t.name == "after-2")
    assert after_payment.runs[-1].returncode == 1
    assert "ActionInDoubt" in after_payment.problems[0]
    charged = [e["key"] for e in world(after_payment.directory)]
    assert len(charged) == 1  # charged once
    assert "the key given now, 'order-7-" in after_payment.problems[0]
    assert f"is not the one it was started under, {charged[0]!r}" in after_payment.problems[0]
    assert "kill after action 2: FAILED" in list(describe(proof))


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_proof_takes_the_run_under_way_with_it(tmp_path: Path, sent: signal.Signals) -> None:
    """The run is a session of its own, which a terminal's Ctrl-C never reaches: a review
    found the agent still running after prove exited 130, its directory deleted under it."""
    pid_file = tmp_path / "agent.pid"
    agent = _script(
        tmp_path,
        f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(60)
        """,
    )
    proving = subprocess.Popen(
        [sys.executable, "-c", _WITH_CTRL_C, "prove", "--timeout-s", "60", "--", *agent],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        proving.send_signal(sent)
        assert proving.wait(timeout=30) == 128 + sent
    finally:
        proving.kill()
    assert not _alive(pid)


# A shell starts a background job (`pytest ... &`, nohup) with SIGINT ignored, and Python
# started so installs no KeyboardInterrupt handler: prove, as any program started so,
# rightly ignores Ctrl-C there. These tests give prove the handler it has when run from a
# terminal, so that they test prove's handling of Ctrl-C wherever pytest runs.
_WITH_CTRL_C = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('durable_sessions', run_name='__main__', alter_sys=True)"
)

# Runs `durable-sessions prove` with a profile hook that raises a real signal in this
# process just after the C call that `when` names returns: where a signal arriving at
# that moment is acted on (Python runs handlers after a call returns), which a test
# cannot otherwise aim a signal at.
_INTERRUPTING_PROVE = """
import os, signal, sys
from durable_sessions.cli import main

signal.signal(signal.SIGINT, signal.default_int_handler)  # see _WITH_CTRL_C

def interrupt(frame, event, called):
    if event == "c_return" and ({when}):
        sys.setprofile(None)
        signal.raise_signal(signal.{sent})

sys.setprofile(interrupt)
sys.exit(main(["prove", "--timeout-s", "60", "--", *sys.argv[1:]]))
"""


def _prove_interrupted(tmp_path: Path, when: str, sent: signal.Signals, agent: list[str]) -> int:
    """The exit code of a proof of ``agent`` sent ``sent`` as ``when`` says; it must end
    within 30 s of it (the run it interrupts sleeps a minute)."""
    driver = tmp_path / "interrupting_prove.py"
    driver.write_text(_INTERRUPTING_PROVE.format(when=when, sent=sent.name))
    proving = subprocess.Popen(
        [sys.executable, str(driver), *agent], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        return proving.wait(timeout=30)
    finally:
        proving.kill()
        proving.wait()


def _sleeping_agent(tmp_path: Path) -> tuple[list[str], Path]:
    """An agent that says its process id in a file, then sleeps a minute; and the file."""
    pid_file = tmp_path / "agent.pid"
    body = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    return _script(tmp_path, body), pid_file


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_as_the_wait_for_the_run_takes_its_lock_still_ends_the_proof(
    tmp_path: Path, sent: signal.Signals
) -> None:
    """Popen.wait(timeout) takes its lock with acquire(False) just before the try that
    releases it: a Ctrl-C acted on between the two left the lock held, and the reaping
    after the kill (process.wait()) waited on it for ever. prove, sent SIGINT, never
    exited (test_an_interrupted_proof_takes_the_run_under_way_with_it, once, under load)."""
    agent, pid_file = _sleeping_agent(tmp_path)
    when = (
        f"frame.f_code.co_name == '_wait' and getattr(called, '__name__', '') == 'acquire'"
        f" and os.path.exists({str(pid_file)!r}) and os.path.getsize({str(pid_file)!r})"
    )
    assert _prove_interrupted(tmp_path, when, sent, agent) == 128 + sent
    assert not _alive(int(pid_file.read_text()))


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_while_the_run_is_being_started_takes_the_run_with_it(
    tmp_path: Path, sent: signal.Signals
) -> None:
    """A Ctrl-C acted on inside Popen, once the agent is started (its exec is done) but
    before the harness holds the process to kill it, left the agent running, in a
    session of its own that no terminal signal reaches."""
    agent, _ = _sleeping_agent(tmp_path)
    when = "frame.f_code.co_name == '_execute_child' and called is os.read"
    assert _prove_interrupted(tmp_path, when, sent, agent) == 128 + sent
    leftovers = [pid for pid in _processes_running(agent[-1]) if _alive(pid)]
    assert not leftovers, "the agent was left running"


def _processes_running(script: str) -> list[int]:
    """The processes whose command line names ``script``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if script.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # ended meanwhile
                continue
    return found


def _alive(pid: int) -> bool:
    """A process that runs: neither gone nor a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    if "zombie" in status:
        return False
    os.kill(pid, signal.SIGKILL)  # the leftover the test found: not left running
    return True


def test_a_skippable_side_effect_stepped_over_is_accounted_for(tmp_path: Path) -> None:
    """replay="skip" is a documented way to make a side effect recoverable: a review found
    that both crash points of such an action failed as "did not come back where it was"."""
    agent = _instrumented(
        tmp_path,
        """
        import json

        @action("a02", "notify", replay="skip")
        def notify():
            with open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "world.jsonl"), "a") as world:
                world.write(json.dumps({"event": "notify"}) + "\\n")
            return "sent"

        with session("s1", journal=journal):
            action("a01", "llm_call")(lambda: 1)()
            notify()
            action("a03", "llm_call")(lambda: 3)()
        """,
    )
    proof = prove(agent, tmp_path / "p")
    lines = list(describe(proof))
    assert proof.passed, "\n".join(lines)
    trials = {t.name: t for t in proof.trials}
    assert trials["before-2"].stepped_over == trials["after-2"].stepped_over == {("s1", "a02")}
    assert trials["after-1"].stepped_over == set()
    assert [len(world(trials[name].directory)) for name in ("before-2", "after-2")] == [0, 1]
    before = lines.index("kill before action 2: resumed")
    assert lines[before + 1].startswith(
        "    stepped over (replay=skip): a02 (session s1); killed before it ran"
    )
    after = lines.index("kill after action 2: resumed")
    assert lines[after + 1].endswith("it ran before the kill and was not repeated")


def test_a_reference_that_replayed_everything_is_told_its_journal_is_not_the_trials(tmp_path: Path) -> None:
    """A fixed journal path, filled by an earlier proof: the reference replays every action
    and passes no boundary, which was reported as "ran no action"."""
    agent = _fixed_journal_agent(tmp_path)
    prove(agent, tmp_path / "first", points=("before",), max_boundaries=1)
    proof = prove(agent, tmp_path / "second")
    assert proof.boundaries == 0 and proof.trials == []
    (problem,) = proof.reference.problems
    assert "it replayed every one it reached (a1, a2) from a journal that is not the trial's" in problem
    assert "{journal}" in problem


def test_results_too_long_for_a_span_stay_in_the_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They went to .durable_sessions/results in the current directory, one file every trial
    overwrote, left behind after the proof (a review)."""
    agent = _instrumented(
        tmp_path,
        """
        with session("s1", journal=journal):
            action("a1", "llm_call")(lambda: "x" * 40_000)()  # over 32 KiB: to the result store
            action("a2", "llm_call")(lambda: 2)()
        """,
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DURABLE_SESSIONS_RESULT_DIR", raising=False)
    proof = prove(agent, tmp_path / "p", points=("before",))
    assert proof.passed, "\n".join(describe(proof))
    assert not (tmp_path / ".durable_sessions").exists()
    assert all((t.directory / "results").is_dir() for t in [proof.reference, *proof.trials])
    # Chosen by the user, it stays where they said.
    chosen = tmp_path / "chosen"
    prove(
        agent,
        tmp_path / "q",
        points=("before",),
        env={**os.environ, "DURABLE_SESSIONS_RESULT_DIR": str(chosen)},
    )
    assert chosen.is_dir() and not (tmp_path / "q" / "reference" / "results").exists()


def test_a_result_the_agents_sdk_cut_is_judged_as_cut(tmp_path: Path) -> None:
    """The agent's environment sets the SDK's attribute value limit: a result cut there is
    a truncated-result warning, as the processor and the sidecar judge it, not an
    invalid-field error for the JSON it no longer is."""
    agent = _instrumented(
        tmp_path,
        """
        with session("s-1"):
            attributes = {"agent.action.id": "r1", "agent.action.kind": "external_read",
                          "agent.action.result": '{"text": "' + "x" * 300 + '"}'}
            with provider.get_tracer("t").start_as_current_span("read", attributes=attributes):
                pass
            action("a1", "clock")(lambda: 1)()
        """,
    )
    proof = prove(
        agent,
        tmp_path / "p",
        points=("before",),
        env={**os.environ, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "100"},
    )
    assert [v.rule for v in proof.reference.violations] == ["truncated-result"]
    assert proof.reference.errors == []


def test_actions_not_come_back_to_are_reported_whatever_the_type_of_their_ids(tmp_path: Path) -> None:
    """A span's action id may be a number (an attribute set as one). Two missing actions,
    one id a number and one text, could not be sorted for the report: prove raised
    TypeError instead of saying the agent did not come back."""
    agent = _instrumented(
        tmp_path,
        """
        marker = os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "ran-before")
        resumed = os.path.exists(marker)
        open(marker, "w").close()
        with session("s-1", journal=journal):
            action("a1", "clock")(lambda: "09:00")()
            if not resumed:  # the bug the proof is for: a resumed run forgets the rest
                action(2, "clock")(lambda: "09:01")()
                action("a3", "clock")(lambda: "09:02")()
        provider.shutdown()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("before",), max_boundaries=1)
    (trial,) = proof.trials
    assert not trial.passed
    (missing,) = [p for p in trial.problems if "did not come back where it was" in p]
    assert "a3 (session s-1)" in missing and "2 (session s-1)" in missing


def test_a_run_that_prints_a_lot_is_not_read_into_memory_whole(tmp_path: Path) -> None:
    # 64 MB of debug output, then the error that matters: only its end is read, and shown.
    agent = _script(
        tmp_path,
        "import sys\n"
        "for _ in range(64):\n"
        "    sys.stdout.write(('debug ' * 170 + '\\n') * 1024)\n"
        "sys.stdout.write('the error that matters\\n')\n"
        "sys.exit(3)",
    )
    tracemalloc.start()
    try:
        proof = prove(agent, tmp_path / "p")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    [problem] = proof.reference.problems
    assert problem.startswith("the reference run exited 3; it printed:\n")
    assert problem.endswith("debug \nthe error that matters")
    assert peak < 8_000_000, f"{peak} bytes at the peak"


def test_an_agent_whose_model_names_its_next_action_is_compared_up_to_where_its_path_changed(
    tmp_path: Path,
) -> None:
    """An agent runs the tool call its model asks for, under the id the model gave the
    call, which is new at every call of the model (as a real model's tool-call ids are).
    Each trial's runs are a fresh execution, whose model answers otherwise than in the
    reference: the reference's tool call never runs in a trial, and the proof failed every
    crash point of an agent that resumes correctly ("the reference completed tool-call_…,
    this trial never did"), at a killed run before the model's answer was journaled and
    after it alike."""
    agent = _instrumented(
        tmp_path,
        """
        import uuid
        with session("s-1", journal=journal):
            call = action("plan", "llm_call")(lambda: {"tool": "fares", "id": "call_" + uuid.uuid4().hex})()
            action(f"tool-{call['id']}", "external_read")(lambda: 100)()
            action("answer", "llm_call")(lambda: "it costs 100")()
        provider.shutdown()
        """,
    )
    proof = prove(agent, tmp_path / "p")
    assert proof.passed, "\n".join(describe(proof))
    assert [len(t.runs) for t in proof.trials] == [2] * 6
    (tool,) = [a for _, a in proof.reference.completed if a.startswith("tool-")]
    # Not compared, and the report says so: the path changed at the model's answer.
    for trial in proof.trials:
        assert trial.another_path == {("s-1", tool)}, trial.name
    (own,) = proof.trials[0].own_path
    lines = list(describe(proof))
    assert lines[2] == (
        f"    took another path after plan (session s-1), whose outcome differs from the reference's, "
        f"to {own[1]} (session s-1): not compared: {tool} (session s-1)"
    )


def test_a_resumed_run_that_forgets_work_fails_though_an_outcome_differs(tmp_path: Path) -> None:
    """An outcome that differs from the reference's excuses only the actions that started
    after it in the reference, and only when the trial ran actions of its own instead:
    one before it, or one after it where the trial took no other path, still fails."""
    agent = _instrumented(
        tmp_path,
        """
        import uuid
        marker = os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "ran-before")
        resumed = os.path.exists(marker)
        open(marker, "w").close()
        with session("s-1", journal=journal):
            if not resumed:  # the bug the proof is for: a resumed run forgets work
                action("a1", "clock")(lambda: "09:00")()
            action("a2", "llm_call")(lambda: uuid.uuid4().hex)()
            if not resumed:
                action("a3", "clock")(lambda: "09:01")()
        provider.shutdown()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("before",), max_boundaries=1)
    (trial,) = proof.trials
    assert trial.another_path == set()
    assert [p for p in trial.problems if "did not come back where it was" in p] == [
        "did not come back where it was: the reference completed a1 (session s-1), a3 (session s-1), "
        "this trial never did"
    ]


def test_the_actions_inside_a_skippable_side_effect_stepped_over_are_dropped_with_it(tmp_path: Path) -> None:
    """A replay="skip" side effect whose body runs actions of its own (a booking that asks
    the model for a quote first): stepped over on resume, its body does not run, nor the
    actions in it. The proof failed three of its four crash points, "the reference
    completed quote, this trial never did", for an agent that resumes as skip says; and
    killed after the quote, before the booking was made, it said the booking "ran before
    the kill"."""
    agent = _instrumented(
        tmp_path,
        """
        import json

        @action("book", "payment", replay="skip")
        def book():
            quote = action("quote", "llm_call")(lambda: 7)()
            with open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "world.jsonl"), "a") as world:
                world.write(json.dumps({"event": "booked", "quote": quote}) + "\\n")
            return "booked"

        with session("s1", journal=journal):
            book()
            action("a03", "llm_call")(lambda: 3)()
        provider.shutdown()
        """,
    )
    proof = prove(agent, tmp_path / "p", max_boundaries=2)
    lines = list(describe(proof))
    assert proof.passed, "\n".join(lines)
    trials = {t.name: t for t in proof.trials}
    assert {name: len(world(t.directory)) for name, t in trials.items()} == {
        "before-1": 0,
        "after-1": 1,
        "before-2": 0,
        "after-2": 0,
    }
    for trial in proof.trials:
        assert trial.stepped_over == {("s1", "book")}, trial.name
    inside = "; the actions inside it were not run again either: quote (session s1)"
    stepped = [line for line in lines if line.startswith("    stepped over")]
    assert stepped == [
        "    stepped over (replay=skip): book (session s1); killed before it ended: what of it ran before the kill "
        "happened once, the rest is dropped (replay=skip: at most once)" + tail
        for tail in (inside, "", inside, inside)
    ]


def test_spans_of_a_provider_given_to_the_actions_reach_the_file_before_the_kill(tmp_path: Path) -> None:
    """Actions given ``tracer_provider=`` (the docs allow it in place of the global one),
    whose spans go out through a BatchSpanProcessor: the crash flushed the global provider
    only, so the spans the killed run ended were lost with it, and an agent without a
    journal, which asks its person again after every crash, passed every crash point."""
    agent = _script(
        tmp_path,
        f"""
        import os, random, sys
        sys.path.insert(0, {str(ROOT / "src")!r})
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from durable_sessions.instrument import action, resource, session
        from durable_sessions.otlp_json import FileSpanExporter

        provider = TracerProvider(resource=resource())
        provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(os.environ["DURABLE_SESSIONS_TRACES"])))

        @action("a01", "user_prompt", tracer_provider=provider)
        def ask():
            return random.randint(1, 10**9)

        @action("a02", "llm_call", tracer_provider=provider)
        def think(answer):
            return answer * 2

        with session("s1"):  # no journal: a resumed run asks again
            think(ask())
        provider.shutdown()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("before",))
    (asked, thought) = proof.trials
    assert asked.passed  # killed before the question: nothing was answered yet
    assert "re-asked" in {v.rule for v in thought.errors}, "\n".join(describe(proof))


# -- files a process killed mid-write left mid-line ------------------------------------------

_WRITE_UNTIL_KILLED = """
import os, signal, sys, threading
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
line = b'{"spans": "' + b"x" * (32 << 20) + b'"}\\n'
threading.Thread(target=lambda: os.write(fd, line), daemon=True).start()
start = os.fstat(fd).st_size
while os.fstat(fd).st_size == start:  # until the thread's write is under way
    pass
os.kill(os.getpid(), signal.SIGKILL)
"""


def _torn_by_a_kill(path: Path) -> None:
    """Leave ``path`` as a process killed by ``SIGKILL`` while a thread of it wrote a long
    line leaves it: mid-line (the kernel stops a write between pages for a fatal signal)."""
    for _ in range(10):  # the kill lands mid-write nearly always; a write done first is retried
        subprocess.run([sys.executable, "-c", _WRITE_UNTIL_KILLED, str(path)], timeout=60, check=False)
        with open(path, "rb") as written:
            written.seek(-1, os.SEEK_END)
            if written.read() != b"\n":
                return
    pytest.fail(f"no kill landed while a line of {path} was being written")


def _last_line(path: Path) -> dict:
    with open(path, "rb") as written:
        return json.loads(written.read().splitlines()[-1])


def test_the_next_processs_spans_do_not_run_on_from_a_line_the_kill_cut(tmp_path: Path) -> None:
    """A resumed agent's FileSpanExporter appended its first line to the one its killed run
    was writing: the two read as one unreadable line, and the resumed run's first spans
    were lost to the check."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from durable_sessions.otlp_json import FileSpanExporter

    traces = tmp_path / "traces.jsonl"
    _torn_by_a_kill(traces)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(traces)))
    provider.get_tracer("t").start_span("after the restart").end()
    provider.shutdown()
    assert [span.name for span in spans_of(_last_line(traces))] == ["after the restart"]


def test_the_next_processs_intents_do_not_run_on_from_a_line_the_kill_cut(tmp_path: Path) -> None:
    """The same for the intent log: the restarted process's first intent, written ahead of
    a side effect, ran on from the cut line and was lost to ``check --intents``."""
    from durable_sessions.intent_log import IntentLog

    intents = tmp_path / "intents.jsonl"
    _torn_by_a_kill(intents)
    log = IntentLog(intents)
    assert log.write({"session_id": "s-1", "action_id": "p2", "kind": "payment", "status": "started"})
    log.close()
    assert _last_line(intents)["action_id"] == "p2"


def test_a_span_the_kill_cut_short_is_not_held_against_the_agent(tmp_path: Path) -> None:
    """A thread of the agent was writing a long span when the crash came, and the kill cut
    its line short: the trial failed on an ``unreadable-line`` that is the crash's own
    mark, though the agent came back where it was. A line that does not read for any
    other reason is still the agent's (the next test)."""
    agent = _instrumented(
        tmp_path,
        """
        import signal, threading
        traces = os.environ["DURABLE_SESSIONS_TRACES"]
        blob = "x" * (32 << 20)

        def export_a_long_span():
            trace.get_tracer("agent").start_span("upload", attributes={"blob": blob}).end()

        with session("s-1", journal=journal):
            action("a1", "clock")(lambda: 1)()
            written = os.path.getsize(traces)
            uploading = threading.Thread(target=export_a_long_span)
            uploading.start()
            while os.path.getsize(traces) == written:  # until the thread's line is under way
                pass
            if os.environ.get("DURABLE_SESSIONS_KILL_AT") == "before:2":
                # The crash point before a2, reached at once: the journal's write ahead of a2
                # may take as long as the thread's line, which the kill must land inside.
                os.kill(os.getpid(), signal.SIGKILL)
            action("a2", "clock")(lambda: 2)()
            uploading.join()
            action("a3", "clock")(lambda: 3)()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("before",))
    report = "\n".join(describe(proof))
    assert proof.passed, report
    assert [t.cut_by_the_kill for t in proof.trials] == [None, 2, None], report
    assert "kill before action 2: resumed\n    traces.jsonl:2 was cut short by the kill" in report


def test_a_line_that_does_not_read_is_held_against_the_agent_whatever_the_kill_did(tmp_path: Path) -> None:
    """An agent that writes a broken line of its own into its traces fails every trial:
    only the one line a kill cut short is the crash's."""
    agent = _instrumented(
        tmp_path,
        """
        with session("s-1", journal=journal):
            action("a1", "clock")(lambda: 1)()
            with open(os.environ["DURABLE_SESSIONS_TRACES"], "ab") as traces:
                traces.write(b'{"resourceSpans": [\\n')
            action("a2", "clock")(lambda: 2)()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("after",))
    assert not proof.reference.passed
    assert [(t.cut_by_the_kill, {v.rule for v in t.errors}) for t in proof.trials] == [
        (None, {"unreadable-line"}),
        (None, {"unreadable-line"}),
    ]


def test_a_last_line_that_lacked_only_its_line_break_is_not_called_cut(tmp_path: Path) -> None:
    """The kill came after a line's text and before its line break: the line reads, and
    the report does not say the kill cut it short."""
    agent = _instrumented(
        tmp_path,
        """
        with session("s-1", journal=journal):
            action("a1", "clock")(lambda: 1)()
            if os.environ.get("DURABLE_SESSIONS_KILL_AT") == "before:2":
                with open(os.environ["DURABLE_SESSIONS_TRACES"], "ab") as traces:
                    traces.write(b'{"resourceSpans": []}')  # a whole request, its line break not written yet
            action("a2", "clock")(lambda: 2)()
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("before",))
    report = "\n".join(describe(proof))
    assert proof.passed, report
    assert [t.cut_by_the_kill for t in proof.trials] == [None, None] and "cut short" not in report


@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "awaitable=True"])
def test_a_sync_function_that_returns_an_awaitable_resumes_awaitable_when_declared(
    tmp_path: Path, declared: bool
) -> None:
    """Killed at ``before`` a sync function that returns a coroutine (or a Task) has not
    returned yet, so the journal cannot note that its caller awaits it: stepped over on
    resume, the call gave back a bare ``None`` and the caller's ``await`` raised TypeError,
    failing the resumed run. Declared ``awaitable=True``, it is handed back awaitable."""
    agent = _instrumented(
        tmp_path,
        f"""
        import asyncio, json

        async def sending(to):
            await asyncio.sleep(0)
            with open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "world.jsonl"), "a") as world:
                world.write(json.dumps({{"event": "email", "to": to}}) + "\\n")
            return {{"sent": to}}

        declared = {{"awaitable": True}} if {declared!r} else {{}}
        by_coroutine = action("a02", "notify", replay="skip", **declared)(lambda: sending("ana"))
        by_task = action("a03", "notify", replay="skip", **declared)(lambda: asyncio.ensure_future(sending("bo")))

        async def main():
            with session("s1", journal=journal):
                action("a01", "llm_call")(lambda: 1)()
                print("a02", await by_coroutine(), flush=True)
                print("a03", await by_task(), flush=True)

        asyncio.run(main())
        """,
    )
    proof = prove(agent, tmp_path / "p", points=("before",))
    lines = "\n".join(describe(proof))
    trials = {t.name: t for t in proof.trials}
    resumed = {name: trial.runs[-1] for name, trial in trials.items()}
    if not declared:
        assert not proof.passed
        for name in ("before-2", "before-3"):
            assert resumed[name].returncode == 1, lines
            assert "TypeError: object NoneType can't be used in 'await' expression" in resumed[name].output
        return
    assert proof.passed, lines
    assert [trial.stepped_over for trial in proof.trials] == [set(), {("s1", "a02")}, {("s1", "a03")}]
    assert [len(world(trials[name].directory)) for name in ("before-1", "before-2", "before-3")] == [2, 1, 1]
    assert resumed["before-2"].output.splitlines() == ["a02 None", "a03 {'sent': 'bo'}"]
    assert resumed["before-3"].output.splitlines() == ["a02 {'sent': 'ana'}", "a03 None"]


def _passed_after(
    agent: list[str], tmp_path: Path, stepped_over: list[set[tuple[str, str]]]
) -> dict[str, Trial]:
    """``agent`` proved at its ``after`` crash points: it passes, each trial steps over the
    actions ``stepped_over`` names for it; its trials by name."""
    proof = prove(agent, tmp_path / "p", points=("after",))
    assert proof.passed, "\n".join(describe(proof))
    assert [trial.stepped_over for trial in proof.trials] == stepped_over
    return {trial.name: trial for trial in proof.trials}


def test_a_task_and_a_generator_returned_by_sync_functions_resume_in_the_shape_they_had(
    tmp_path: Path,
) -> None:
    """Killed after a Task was done, or after a generator was exhausted, the resumed call
    is handed back what the first run's caller got: a done Future (its callback, ``done()``
    and ``result()`` worked on the coroutine the replay was, AttributeError), and a
    generator of the items (the replay was ``None``, and ``list(None)`` a TypeError).
    Stepped over while in doubt, they are a done Future of ``None`` and an empty generator.
    The charge and the emails happen once, whatever the crash."""
    agent = _instrumented(
        tmp_path,
        """
        import asyncio, json

        def happened(event, to):
            with open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "world.jsonl"), "a") as world:
                world.write(json.dumps({"event": event, "to": to}) + "\\n")

        async def charging(card):
            await asyncio.sleep(0)
            happened("charge", card)
            return {"charged": card}

        def emails(to):
            def sending():
                for name in to:
                    happened("email", name)
                    yield {"sent": name}
            return sending()

        charge = action("a01", "payment", replay="skip")(lambda: asyncio.ensure_future(charging("visa")))
        notify = action("a02", "notify", replay="skip")(emails)

        async def main():
            with session("s1", journal=journal):
                task = charge()
                called = []
                task.add_done_callback(lambda done: called.append(done.result()))
                await task
                await asyncio.sleep(0)  # the callback runs
                print("a01", task.done(), task.result(), called, flush=True)
                print("a02", list(notify(["ana", "bo"])), flush=True)
                action("a03", "llm_call")(lambda: 3)()

        asyncio.run(main())
        """,
    )
    trials = _passed_after(agent, tmp_path, stepped_over=[{("s1", "a01")}, {("s1", "a02")}, set()])
    for trial in trials.values():
        events = world(trial.directory)
        assert [e["to"] for e in events if e["event"] == "charge"] == ["visa"], trial.name
        assert [e["to"] for e in events if e["event"] == "email"] == ["ana", "bo"], trial.name
    charged = "a01 True {'charged': 'visa'} [{'charged': 'visa'}]"
    sent = "a02 [{'sent': 'ana'}, {'sent': 'bo'}]"
    assert trials["after-1"].runs[-1].output.splitlines() == ["a01 True None [None]", sent]
    assert trials["after-2"].runs[-1].output.splitlines() == [charged, "a02 []"]
    assert trials["after-3"].runs[-1].output.splitlines() == [charged, sent]


def test_a_task_a_coroutine_function_gives_resumes_as_a_done_future(tmp_path: Path) -> None:
    """``async def start(): return asyncio.ensure_future(charge())``: killed after the Task
    was done, the await of the resumed call gives a done Future of its result (it gave
    ``None``: the Task is no JSON, so nothing was recorded, and ``None.add_done_callback``
    raised AttributeError); stepped over while in doubt, a done Future of ``None``. The
    charge happens once, whatever the crash (the kill came before the Task ran, and the
    step over left it never charged)."""
    agent = _instrumented(
        tmp_path,
        """
        import asyncio, json

        async def charging(card):
            await asyncio.sleep(0)
            with open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "world.jsonl"), "a") as world:
                world.write(json.dumps({"event": "charge", "to": card}) + "\\n")
            return {"charged": card}

        async def start(card):
            await asyncio.sleep(0)
            return asyncio.ensure_future(charging(card))

        charge = action("a01", "payment", replay="skip")(start)

        async def main():
            with session("s1", journal=journal):
                task = await charge("visa")
                called = []
                task.add_done_callback(lambda done: called.append(done.result()))
                await task
                await asyncio.sleep(0)  # the callback runs
                print("a01", task.done(), task.result(), called, flush=True)
                action("a02", "llm_call")(lambda: 2)()

        asyncio.run(main())
        """,
    )
    trials = _passed_after(agent, tmp_path, stepped_over=[{("s1", "a01")}, set()])
    for trial in trials.values():
        assert [e["to"] for e in world(trial.directory)] == ["visa"], trial.name
    assert trials["after-1"].runs[-1].output.splitlines() == ["a01 True None [None]"]
    assert trials["after-2"].runs[-1].output.splitlines() == [
        "a01 True {'charged': 'visa'} [{'charged': 'visa'}]"
    ]


def test_an_async_generator_returned_by_a_sync_function_resumes_as_an_async_generator(tmp_path: Path) -> None:
    """Killed after its async generator was exhausted, the resumed call is handed back an
    async generator of the items (the replay was ``None``, and ``async for`` over it a
    TypeError); stepped over while in doubt, an empty one. The emails go out once."""
    agent = _instrumented(
        tmp_path,
        """
        import asyncio, json

        def emails(to):
            async def sending():
                for name in to:
                    await asyncio.sleep(0)
                    with open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "world.jsonl"), "a") as world:
                        world.write(json.dumps({"event": "email", "to": name}) + "\\n")
                    yield {"sent": name}
            return sending()

        notify = action("a01", "notify", replay="skip")(emails)

        async def main():
            with session("s1", journal=journal):
                print("a01", [item async for item in notify(["ana", "bo"])], flush=True)
                action("a02", "llm_call")(lambda: 2)()

        asyncio.run(main())
        """,
    )
    trials = _passed_after(agent, tmp_path, stepped_over=[{("s1", "a01")}, set()])
    for trial in trials.values():
        assert [e["to"] for e in world(trial.directory)] == ["ana", "bo"], trial.name
    assert trials["after-1"].runs[-1].output.splitlines() == ["a01 []"]
    assert trials["after-2"].runs[-1].output.splitlines() == ["a01 [{'sent': 'ana'}, {'sent': 'bo'}]"]


def test_a_stream_a_coroutine_function_gives_resumes_as_a_stream_of_its_items(tmp_path: Path) -> None:
    """``async def f(): return stream()``, of either kind: killed after the stream was
    exhausted, the await of the resumed call gives a stream of the same kind of its items
    (it gave ``None``, and the caller's loop over it raised TypeError); stepped over while
    in doubt, an empty one. Each email goes out once, whatever the crash."""
    agent = _instrumented(
        tmp_path,
        """
        import asyncio, json

        def email(name):
            with open(os.path.join(os.environ["DURABLE_SESSIONS_DIR"], "world.jsonl"), "a") as world:
                world.write(json.dumps({"event": "email", "to": name}) + "\\n")
            return {"sent": name}

        async def emails_async(to):
            await asyncio.sleep(0)
            async def sending():
                for name in to:
                    await asyncio.sleep(0)
                    yield email(name)
            return sending()

        async def emails(to):
            await asyncio.sleep(0)
            return (email(name) for name in to)

        notify_async = action("a01", "notify", replay="skip")(emails_async)
        notify = action("a02", "notify", replay="skip")(emails)

        async def main():
            with session("s1", journal=journal):
                print("a01", [item async for item in await notify_async(["ana", "bo"])], flush=True)
                print("a02", list(await notify(["cy"])), flush=True)
                action("a03", "llm_call")(lambda: 3)()

        asyncio.run(main())
        """,
    )
    trials = _passed_after(agent, tmp_path, stepped_over=[{("s1", "a01")}, {("s1", "a02")}, set()])
    for trial in trials.values():
        assert [e["to"] for e in world(trial.directory)] == ["ana", "bo", "cy"], trial.name
    sent_async, sent = "a01 [{'sent': 'ana'}, {'sent': 'bo'}]", "a02 [{'sent': 'cy'}]"
    assert trials["after-1"].runs[-1].output.splitlines() == ["a01 []", sent]
    assert trials["after-2"].runs[-1].output.splitlines() == [sent_async, "a02 []"]
    assert trials["after-3"].runs[-1].output.splitlines() == [sent_async, sent]
