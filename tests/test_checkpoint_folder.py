"""A Hugging Face checkpoint folder as the model of a distributed audit: the workers (--workers 2,
Ray) rebuild it from its checkpoint files only (config, safetensors, tokenizer), the report's digest
covers exactly those files, and a file linked from outside the folder is refused (exit 2) before
anything reads it, but for a Hugging Face cache snapshot's links into its blobs. The checkpoint is
a tiny 2-block GPT-2 saved with save_pretrained into tmp_path."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from test_cli import assert_one_line_error, run_cli
from test_hf_checkpoints import tiny_checkpoint

from splitaudit.core.config import AuditOptions
from splitaudit.engine.pipeline import run_audit
from splitaudit.execution.recipe import model_files

CHECKPOINT_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
ATTACKS = ["token-inversion", "decoder"]  # two tasks: one for each worker


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny GPT-2 beside what a training folder also holds: an optimizer state, a log folder."""
    folder = tmp_path_factory.mktemp("gpt2")
    tiny_checkpoint("gpt2", folder)
    (folder / "optimizer.pt").write_bytes(b"not a checkpoint file: never copied nor hashed")
    (folder / "runs").mkdir()
    (folder / "runs" / "events.log").write_text("step 1\n")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("".join(" ".join(f"w{i}" for i in rng.integers(2, 48, 8)) + "\n" for _ in range(40)))
    return path


def audit(folder, corpus, out, **extra) -> dict:
    options = AuditOptions(
        model=str(folder),
        split_layer=1,
        aux=str(corpus),
        attacks=ATTACKS,
        quick=True,
        prior="gaussian",
        noise_sigma=0.1,
        device="cpu",
        formats=["json"],
        out=str(out),
        **extra,
    )
    return run_audit(options.validate())


def numbers(report: dict) -> dict:
    return {name: (report["attacks"][name]["status"], report["attacks"][name].get("metrics")) for name in ATTACKS}


@pytest.fixture(scope="module")
def in_process(folder, corpus, tmp_path_factory):
    return audit(folder, corpus, tmp_path_factory.mktemp("local"))


def test_workers_ship_only_the_checkpoint_files(folder):
    assert sorted(model_files(str(folder))) == [f"{folder.name}/{name}" for name in CHECKPOINT_FILES]


def test_two_worker_processes_rebuild_the_folder_and_give_the_in_process_numbers(folder, corpus, in_process, tmp_path):
    pooled = audit(folder, corpus, tmp_path, workers=2)
    assert numbers(pooled) == numbers(in_process)
    assert all(status == "ok" for status, _ in numbers(pooled).values())
    workers = {t["worker"] for t in pooled["run"]["tasks"]}
    assert len(workers) == 2 and all(w.startswith("local/") for w in workers)


def test_the_digest_covers_the_checkpoint_files_as_sha256sum_lists_them(folder, in_process):
    """The folder's record is SHA-256 over `sha256sum` lines of the four checkpoint files, sorted by
    name; the optimizer state and the log beside them are not part of it."""
    listing = "".join(
        f"{hashlib.sha256((folder / name).read_bytes()).hexdigest()}  {name}\n" for name in CHECKPOINT_FILES
    )
    record = next(r for r in in_process["provenance"]["files"] if r["role"] == "model")
    assert (record["kind"], record["files"]) == ("folder", 4)
    assert record["sha256"] == hashlib.sha256(listing.encode()).hexdigest()
    assert record["bytes"] == sum((folder / name).stat().st_size for name in CHECKPOINT_FILES)


def test_a_file_linked_from_outside_the_folder_is_refused(folder, corpus, tmp_path, capsys):
    linked = tmp_path / "linked"
    linked.mkdir()
    for name in CHECKPOINT_FILES:
        (linked / name).write_bytes((folder / name).read_bytes())
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((linked / "tokenizer.json").read_bytes())
    (linked / "tokenizer.json").unlink()
    (linked / "tokenizer.json").symlink_to(outside)
    code, _, err = run_cli(
        ["run", str(linked), "--split-layer", "1", "--aux", str(corpus), "--attacks", "none", "--quick"], capsys
    )
    assert_one_line_error(code, err, "leads out of the checkpoint folder")


def test_a_link_inside_the_folder_is_read(folder, tmp_path):
    """A checkpoint whose weights file links to a blob inside the folder is shipped with its bytes."""
    inside = tmp_path / "inside"
    (inside / "blobs").mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        (inside / name).write_bytes((folder / name).read_bytes())
    (inside / "model.safetensors").rename(inside / "blobs" / "weights")
    (inside / "model.safetensors").symlink_to("blobs/weights")
    shipped = model_files(str(inside))
    assert shipped["inside/model.safetensors"] == (folder / "model.safetensors").read_bytes()


def test_a_hugging_face_cache_snapshot_is_read_through_its_blobs(folder, corpus, tmp_path, capsys):
    """models--NAME/snapshots/REV/FILE -> ../../blobs/SHA, as from_pretrained downloads: the files are
    read (and shipped to workers) through the links; a link elsewhere in the repository is refused."""
    repository = tmp_path / "models--tiny"
    snapshot, blobs = repository / "snapshots" / "0123abc", repository / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in CHECKPOINT_FILES:
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        (blobs / digest).write_bytes((folder / name).read_bytes())
        (snapshot / name).symlink_to(f"../../blobs/{digest}")
    shipped = model_files(str(snapshot))
    assert shipped == {f"0123abc/{name}": (folder / name).read_bytes() for name in CHECKPOINT_FILES}
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_bytes((folder / "tokenizer.json").read_bytes())
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to("../../refs/main")
    code, _, err = run_cli(
        ["run", str(snapshot), "--split-layer", "1", "--aux", str(corpus), "--attacks", "none", "--quick"], capsys
    )
    assert_one_line_error(code, err, "leads out of the checkpoint folder")


@pytest.mark.slow
def test_ray_workers_rebuild_the_folder_from_the_object_store(folder, corpus, in_process, tmp_path):
    ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "splitaudit[ray]")')
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        remote = audit(folder, corpus, tmp_path, executor="ray")
    finally:
        ray.shutdown()
    assert numbers(remote) == numbers(in_process)
    assert (remote["run"]["executor"], remote["run"]["workers"]) == ("ray", 2)
