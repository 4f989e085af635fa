"""runner.api without a cluster: the plan is data, render() is exactly what `runner up --dry-run`
prints, the YAML is read once, a backend's options are refused on the other backend both ways (the
CLI and the API), a verb a backend does not have is one line, and the one RunStatus schema holds
both backends' documents. Nothing here contacts anything (`no_network`, or a child whose every
socket is fatal)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
import yaml

from runner import api
from runner.backends.results import NodeStatus, RunStatus, run_state, slurm_state
from runner.cli.main import main as runner_main
from tests import REPO
from tests.support.runner_helpers import no_socket_env, runner

PIS, SLURM = REPO / "hosts" / "pis.yaml", REPO / "hosts" / "slurm.yaml"


@pytest.mark.parametrize("path", [PIS, SLURM], ids=["pis", "slurm"])
def test_plan_render_is_what_dry_run_prints_and_contacts_nothing(path, no_network, capsys, tmp_path, monkeypatch):
    """The issue's words, on a laptop without the cluster's key (a HOME with no ~/.ssh): loading
    checks no key file (a verb that connects refuses a missing one), and the plan is the dry-run's."""
    monkeypatch.setenv("HOME", str(tmp_path))
    plan = api.backend_for(api.load_inventory(path)).plan()
    assert runner_main(["up", "-i", str(path), "--dry-run"]) == 0
    assert plan.render() == capsys.readouterr().out
    assert plan.render().startswith("run <new run id>: ") and plan.render().endswith("\n")
    if path == PIS:  # the key the nodes need is still refused, by the CLI's verbs that connect
        with pytest.raises(api.UserError, match=r"pis.yaml:3: defaults.identity_file: file not found: "):
            api.load_inventory(path, check_files=True)


def test_an_unchecked_load_keeps_the_key_a_connection_would_use(tmp_path, monkeypatch, no_network):
    """An ssh config listing a missing IdentityFile before one that exists: loaded unchecked (the
    API's default), the node's key is the existing one, as a checked load (the CLI's) picks."""
    monkeypatch.setenv("HOME", str(tmp_path))
    key = tmp_path / "real_key"
    key.write_text("only its existence is checked\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host n0\n    HostName 192.0.2.10\n    IdentityFile {tmp_path}/missing_key\n"
                   f"    IdentityFile {key}\nHost n1\n    HostName 192.0.2.11\n    IdentityFile {tmp_path}/gone\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"defaults: {{ssh_config: {cfg}, user: u}}\nnodes:\n  - {{name: a, host: n0}}\n"
                   "  - {name: b, host: n1}\njob: {image: 'x:1'}\n")
    checked = api.load_inventory(inv, check_files=True)
    unchecked = api.load_inventory(inv)
    assert [n.identity_file for n in checked.nodes] == [str(key), None]
    assert [n.identity_file for n in unchecked.nodes] == [str(key), f"{tmp_path}/gone"]


def test_the_dry_run_in_a_child_without_sockets_prints_the_same(tmp_path):
    res = runner("up", "-i", str(PIS), "--dry-run", env=no_socket_env(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout == api.backend_for(api.load_inventory(PIS)).plan().render()


def test_an_ssh_plan_is_data(no_network):
    backend = api.backend_for(api.load_inventory(PIS, check_files=False))
    assert isinstance(backend, api.SshBackend)
    loaded_args = list(backend.inventory.job.args)
    plan = backend.plan(api.SshUpOptions(trainer_args=["--train.steps", "7"], max_restarts=2))
    assert plan.backend == "ssh" and plan.run_id == "<new run id>" and plan.ranks == {"pi-0": 0, "pi-1": 1, "pi-2": 2}
    assert plan.images == {"pi-0": "runner-trainer:arm64", "pi-1": "runner-trainer:arm64", "pi-2": "runner-trainer:arm64"}
    for n in plan.nodes:
        assert (n.env["NODE_RANK"], n.env["NNODES"], n.env["MASTER_ADDR"]) == (str(n.rank), "3", "192.168.1.10")
        cmd = n.command
        assert cmd[cmd.index("--node-rank") + 1] == str(n.rank) and cmd[-2:] == ["--train.steps", "7"], cmd
    assert plan.options.max_restarts == 2 and plan.refusal is None
    # planning twice leaves the loaded inventory as it was: the trainer args are not appended twice
    again = backend.plan({"trainer_args": ["--train.steps", "7"]})
    assert again.nodes[0].command == plan.nodes[0].command and backend.inventory.job.args == loaded_args
    assert json.loads(json.dumps(plan.as_dict()))["nodes"][2]["node"] == "pi-2"


def test_a_slurm_plan_is_data(no_network):
    backend = api.backend_for(api.load_inventory(SLURM, check_files=False))
    assert isinstance(backend, api.SlurmBackend)
    plan = backend.plan(api.SlurmUpOptions(requeue=True))
    assert plan.backend == "slurm" and plan.ranks == {f"node-{k}": k for k in range(4)}
    assert set(plan.images.values()) == {"ghcr.io#example/runner-trainer:latest"}
    assert "--requeue" in plan.detail.script and "#SBATCH --nodes=4" in plan.detail.script
    for n in plan.nodes:
        assert n.env["NODE_RANK"] == str(n.rank) and n.env["NNODES"] == "4" and n.env["OUTPUT_DIR"] == "/out"
        assert n.command[n.command.index("--node-rank") + 1] == str(n.rank)


def test_the_yaml_is_read_once_per_load(no_network, monkeypatch):
    """Before: once to choose the backend (top_level_keys), once more by the backend's loader."""
    from runner.inventory import load, schema, slurm

    calls = []
    real = schema.read_yaml
    for module in (schema, load, slurm):
        monkeypatch.setattr(module, "read_yaml", lambda path, what: calls.append(path) or real(path, what))
    assert isinstance(api.load_inventory(PIS, check_files=False), api.SshInventory)
    assert isinstance(api.load_inventory(SLURM, check_files=False), api.SlurmInventory)
    assert calls == [str(PIS), str(SLURM)]


def test_an_inventory_with_both_sections_is_read_for_the_scheduler_asked(tmp_path, no_network):
    doc = yaml.safe_load(PIS.read_text())
    doc["slurm"] = yaml.safe_load(SLURM.read_text())["slurm"]
    p = tmp_path / "both.yaml"
    p.write_text(yaml.safe_dump(doc))
    ssh = api.load_inventory(p, check_files=False)
    assert api.backend_for(ssh).name == "ssh"
    with pytest.raises(api.UserError, match=r"loaded as a SSH inventory, not for --scheduler slurm; load it with "):
        api.backend_for(ssh, "slurm")
    slurm = api.load_inventory(p, check_files=False, scheduler="slurm")
    assert api.backend_for(slurm, "slurm").name == "slurm"
    with pytest.raises(api.UserError, match="needs a `slurm:` section"):
        api.load_inventory(PIS, check_files=False, scheduler="slurm")


def test_an_option_of_the_other_backend_is_refused_in_the_api(no_network):
    slurm = api.backend_for(api.load_inventory(SLURM, check_files=False))
    ssh = api.backend_for(api.load_inventory(PIS, check_files=False))
    with pytest.raises(api.UserError) as e:
        slurm.plan(api.SshUpOptions(no_push=True, reclaim_timeout=5))
    assert str(e.value) == ("--no-push, --reclaim-timeout are for SSH runs (--scheduler ssh); this run goes to Slurm "
                            f"({SLURM})")
    with pytest.raises(api.UserError, match=r"^--requeue is for Slurm runs \(--scheduler slurm\); SSH runs use "):
        ssh.plan({"requeue": True})
    with pytest.raises(api.UserError, match=r"^frobnicate: not an option of any backend \(the options of SSH runs: "):
        ssh.plan({"frobnicate": 1})
    # the common options, given through another backend's class, are taken
    assert slurm.plan(api.SshUpOptions(resume="20260101-000000-abcd")).run_id == "20260101-000000-abcd"


def test_the_done_when_check_an_ssh_flag_on_a_slurm_run_exits_non_zero_in_one_line(tmp_path):
    """Before: exit 0, both flags silently dropped (SshBackend.options was empty)."""
    res = runner("up", "-i", str(SLURM), "--dry-run", "--no-push", "--reclaim-timeout", "5", env=no_socket_env(tmp_path))
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert res.stderr == ("runner: error: --no-push, --reclaim-timeout are for SSH runs (--scheduler ssh); this run "
                          f"goes to Slurm ({SLURM})\n")


def test_a_slurm_flag_on_an_ssh_run_exits_non_zero_in_one_line(no_network, capsys):
    assert runner_main(["up", "-i", str(PIS), "--dry-run", "--requeue"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("runner: error: --requeue is for Slurm runs (--scheduler slurm); SSH runs use "
                                 "--max-restarts\n")


def test_a_verb_a_backend_does_not_have_is_one_line(tmp_path, no_network, capsys):
    (tmp_path / "s.yaml").write_text("slurm: {nodes: 2, partition: debug}\njob: {image: 'x:1'}\n")
    slurm = api.backend_for(api.load_inventory(SLURM, check_files=False))
    for verb in ("push", "sync", "profile"):
        with pytest.raises(api.UserError) as e:
            getattr(slurm, verb)()
        msg = str(e.value)
        assert msg.startswith(f"`runner {verb}` is not for Slurm runs ({SLURM}): ") and "\n" not in msg, msg
    assert "container pyxis: each node's enroot pulls" in str(pytest.raises(api.UserError, slurm.push).value)
    assert runner_main(["sync", "-i", str(tmp_path / "s.yaml")]) == 2
    assert capsys.readouterr().err.startswith("runner: error: `runner sync` is not for Slurm runs")


def test_an_ssh_only_argument_of_a_verb_is_refused_on_slurm_before_any_contact(no_network):
    """`down --keep-runs` and `logs --logs-dir` name SSH nodes' own dirs: on a Slurm run each is one
    line saying where that run's files are, raised before a login shell is opened."""
    slurm = api.backend_for(api.load_inventory(SLURM))
    with pytest.raises(api.Unsupported) as e:
        slurm.cancel("20260101-000000-abcd", keep_runs=2)
    assert str(e.value) == (f"--keep-runs is for SSH runs: a Slurm run's dir is on the shared filesystem ({SLURM}: "
                            "slurm.workdir); remove old ones there") and e.value.exit_code == 2
    with pytest.raises(api.Unsupported, match=r"^--logs-dir is for SSH runs: a Slurm run's output stays in its run dir"):
        slurm.logs(logs_dir="artifacts")
    assert slurm.shapes() == [("amd64", 8, 8)] * 4 and slurm.shapes("arm64", 2) == [("arm64", 2, 2)] * 4


def test_importing_the_api_needs_no_torch_or_trainer():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from runner.api import load_inventory, backend_for\n"
            "print(sorted(m for m, v in sys.modules.items() if v is not None\n"
            "             and m.split('.')[0] in ('torch', 'trainer', 'paramiko', 'docker')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_states_of_ssh_nodes_and_slurm_jobs():
    assert run_state([("running", None), ("exited", 0)])[0] == "running"
    assert run_state([("created", None), ("created", None)])[0] == "pending"
    assert run_state([("finished", 0), ("finished", 0)]) == ("succeeded", "finished", 0)
    assert run_state([("exited", 0), ("exited", 143), ("exited", 1)]) == ("failed", "exited", 143)
    assert run_state([("no container", None), ("finished", 0)])[0] == "stopped"
    assert run_state([("unreachable", None)]) == ("unknown", "absent", None)
    assert [slurm_state(s, c, d) for s, c, d in [("COMPLETED", 0, False), ("FAILED", 143, True), ("FAILED", 1, False),
                                                  ("GONE", None, False), ("PENDING", None, False),
                                                  ("CANCELLED", None, False), ("TIMEOUT", None, False)]] == [
        "succeeded", "stopped", "failed", "unknown", "pending", "stopped", "failed"]


def test_the_schema_holds_both_backends_documents_and_refuses_a_wrong_one():
    schema = api.run_status_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    ssh = RunStatus("ssh", "hosts/local.yaml", "20260101-000000-abcd", "running", "running", None,
                    [NodeStatus("node-0", 0, "running", None, "3s", '{"step": 1}',
                                {"step": 1, "total": 8, "loss": 2.5, "tokens_per_s": 10.0, "eta_s": 4.0})])
    slurm = RunStatus("slurm", "hosts/slurm.yaml", "20260101-000000-abcd", "succeeded", "COMPLETED", 0,
                      [NodeStatus("c1", 0, "COMPLETED")], job_id="42", submissions=1, run_dir="/s/runs/x")
    for st in (ssh, slurm):
        doc = json.loads(json.dumps(st.as_dict()))
        jsonschema.validate(doc, schema)
        assert doc["schema"] == api.SCHEMA_VERSION == 1 and list(doc)[0] == "schema"
    bad = {**slurm.as_dict(), "state": "COMPLETED"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_a_plan_without_a_notification_leaves_the_notifier_unimported(no_network, monkeypatch):
    """The notifier (urllib, ssl) is imported only for a run that asks to be told; the environment
    variable it reads is the one up_job looks at first."""
    from runner.backends import base, notify

    assert base.NOTIFY_ENV == notify.ENV_NAME
    monkeypatch.delenv(notify.ENV_NAME, raising=False)
    code = ("import sys\nfrom runner import api\n"
            f"api.backend_for(api.load_inventory({str(PIS)!r}, check_files=False)).plan()\n"
            "print('runner.backends.notify' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                       env={k: v for k, v in __import__("os").environ.items() if k != notify.ENV_NAME})
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr
    monkeypatch.setenv(notify.ENV_NAME, "notify-send x")
    backend = api.backend_for(api.load_inventory(PIS, check_files=False))
    assert backend.plan().prepared.notify.argv == ("sh", "-c", "notify-send x")


def test_check_of_a_slurm_inventory_asks_slurm_not_for_nodes(tmp_path, monkeypatch, capsys):
    """Before: `runner check` of a Slurm inventory failed with `nodes: missing`. Now it checks where
    Slurm's commands run (this machine here, whose PATH has no Slurm tools): one line, exit 1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sh").symlink_to(__import__("shutil").which("sh"))
    inv = tmp_path / "s.yaml"
    inv.write_text("slurm: {nodes: 2, partition: debug}\njob: {image: 'x:1'}\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    report = api.backend_for(api.load_inventory(inv)).check()
    assert not report.ok and report.items[0].tools_missing == ["sbatch", "squeue", "scancel", "scontrol", "sinfo"]
    assert runner_main(["check", "-i", str(inv)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"check {inv} (Slurm, from this machine)",
                                "  tools      missing: sbatch, squeue, scancel, scontrol, sinfo"]
    assert err == (f"runner: error: check failed: {inv}: slurm: sbatch, squeue, scancel, scontrol, sinfo not found on "
                   "this machine (set slurm.login to a login node)\n")


def test_the_cli_renders_both_backends_run_statuses(monkeypatch, capsys):
    """`status` and `ls` print what describe() and runs() return, whichever backend: the text of a
    Slurm run, the node table of an SSH run, one `ls` table of both, and the same document as --json."""
    from types import SimpleNamespace

    from runner.cli import runs

    ssh = RunStatus("ssh", "inv.yaml", "20260101-000000-aaaa", "running", "running", None,
                    [NodeStatus("node-0", 0, "running", None, "3s", None,
                                {"step": 3, "total": 10, "loss": 2.25, "tokens_per_s": 1000.0, "eta_s": 14.0})])
    slurm = RunStatus("slurm", "s.yaml", "20260101-000000-bbbb", "failed", "FAILED", 143,
                      [NodeStatus("c1", 0, "FAILED")], job_id="42", submissions=2, run_dir="/s/runs/b",
                      reason="NonZeroExitCode", run_time="00:01:00", last_metrics='{"step": 3}')
    fake = SimpleNamespace(path="inv.yaml", describe=lambda run: {"a": ssh, "b": slurm}[run], runs=lambda: [ssh, slurm])
    monkeypatch.setattr(runs, "open_backend", lambda args, **kw: fake)
    assert runs.cmd_status(SimpleNamespace(run="b", json=False)) == 0
    assert capsys.readouterr().out.splitlines() == [
        "run 20260101-000000-bbbb: Slurm job 42 FAILED (NonZeroExitCode), exit 143, 00:01:00; submission 2; "
        "run dir /s/runs/b", "  [c1/0]", '  last metrics: {"step": 3}']
    assert runs.cmd_status(SimpleNamespace(run="a", json=False)) == 0
    table = capsys.readouterr().out
    assert "run 20260101-000000-aaaa" in table and "step 3/10  loss 2.2500  1.0K tok/s  ETA 0:00:14" in table
    assert runs.cmd_ls(SimpleNamespace(json=False)) == 0
    listed = capsys.readouterr().out
    assert "node-0:running" in listed and "Slurm job 42 (FAILED), submissions 2" in listed
    assert runs.cmd_ls(SimpleNamespace(json=True)) == 0
    assert json.loads(capsys.readouterr().out) == [ssh.as_dict(), slurm.as_dict()]
