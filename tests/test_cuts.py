"""`splitaudit cuts`: the candidate cuts of a whole model, its halves, one audit per cut, and a
recommendation that follows from the numbers.

Closed form: on a chain of linear layers x -> A1 x -> A2 A1 x -> ... the Jacobian at cut k is
P_k = A_k ... A_1, so dFIL = ||P_k||_F^2 / (d sigma^2) exactly, and with the Gaussian prior N(0, s^2 I)
the van Trees bound is 1 / (dFIL + 1/s^2) (Maeng et al., NeurIPS 2023)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import sample
from onnx import TensorProto, helper, numpy_helper

from splitaudit.cli import main
from splitaudit.core.config import AuditOptions
from splitaudit.engine.cuts import run_cuts
from splitaudit.inputs.onnx_cuts import candidate_cuts, open_whole_model, run_onnx, split_at
from splitaudit.verdicts.recommend_cut import qualifies, recommend_cut
from tests.support.architectures import build, export_onnx

D, SIGMA, S = 6, 0.5, 0.8  # input size, --noise-sigma, the data's per-dimension std


def _exit_code(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code


def _chain(path: Path) -> tuple[Path, list[np.ndarray]]:
    """x [N, D] -> MatMul W1 -> h1 -> Gemm (W2, transB) -> h2 -> MatMul W3 -> logits [N, 3]; returns the
    maps A_k (h_k = A_k h_{k-1}) as matrices."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(D, 5)).astype(np.float32)  # h1 = x @ w1: A1 = w1.T
    w2 = rng.normal(size=(4, 5)).astype(np.float32)  # Gemm transB: h2 = h1 @ w2.T: A2 = w2
    w3 = rng.normal(size=(4, 3)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Gemm", ["h1", "w2"], ["h2"], transB=1),
        helper.make_node("MatMul", ["h2", "w3"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "features"])],  # the size from the data
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path, [w1.T, w2, w3.T]


def _gaussian_data(path: Path, n: int, seed: int, model: Path) -> Path:
    """N(0, S^2 I) samples standardised to per-dimension variance exactly S^2, labelled by the model."""
    x = np.random.default_rng(seed).normal(size=(n, D))
    x = (x - x.mean(0)) / x.std(0, ddof=1) * S
    whole = open_whole_model(model, (D,))
    y = run_onnx(whole.proto, x.astype(np.float32)).argmax(1)
    np.savez(path, x=x.astype(np.float32), y=y)
    return path


@pytest.fixture
def chain(tmp_path):
    model, maps = _chain(tmp_path / "chain.onnx")
    aux = _gaussian_data(tmp_path / "aux.npz", 400, 1, model)
    target = _gaussian_data(tmp_path / "target.npz", 200, 2, model)
    return model, maps, aux, target


def _numbers(document: dict) -> str:
    """The document without what says when and where it ran (wall times, dates, workers)."""
    times = {"started": None, "ended": None}
    cuts = [{**c, "seconds": 0} for c in document["cuts"]]
    return json.dumps({**document, "run": {}, "cuts": cuts, "provenance": {**document["provenance"], **times}})


def _options(model, aux, target=None, **extra) -> AuditOptions:
    return AuditOptions(model=str(model), aux=str(aux), target=target and str(target), quick=True, **extra).validate()


def test_linear_chain_matches_the_closed_form_at_every_cut(chain):
    model, maps, aux, target = chain
    options = _options(model, aux, target, prior="gaussian", attacks=["none"], cut_noise_sigma=SIGMA)
    document = run_cuts(options)
    assert [c["name"] for c in document["cuts"]] == ["h1", "h2"]  # the output is no cut; x is the input
    assert document["prior"]["J_over_d"] == pytest.approx(1 / S**2, rel=0.01)
    product = np.eye(D)
    for cut, a in zip(document["cuts"], maps):
        product = a.astype(np.float64) @ product
        dfil = np.sum(product**2) / (D * SIGMA**2)
        assert cut["noise_sigma"] == SIGMA and cut["sigma_source"] == "--noise-sigma"
        assert cut["dfil"]["mean"] == pytest.approx(dfil, rel=0.01)
        assert cut["bounds"]["van_trees_mse"] == pytest.approx(1 / (dfil + 1 / S**2), rel=0.01)
        assert cut["bytes_sent"] == 4 * product.shape[0]
        assert cut["parity_max_abs_err"] <= 1e-5
    # client cost from the shapes: h1 = x @ w1 is D*5 MACs, h2 adds 5*4
    assert [c["flops"] for c in document["cuts"]] == [2 * D * 5, 2 * (D * 5 + 5 * 4)]
    assert [c["params"] for c in document["cuts"]] == [D * 5, D * 5 + 4 * 5]
    assert document["whole_accuracy"]["accuracy"] == 1.0  # labels are the model's own answers


def test_calibrated_cuts_reach_the_target_and_a_second_call_gives_the_same_document(chain):
    model, _, aux, target = chain
    options = _options(model, aux, target, prior="gaussian", attacks=["none"], target_mse=0.3)
    first, second = run_cuts(options), run_cuts(options)
    assert _numbers(first) == _numbers(second)
    for cut in first["cuts"]:
        assert cut["sigma_source"] == "calibrated"
        assert cut["bounds"]["van_trees_mse"] == pytest.approx(0.3, rel=1e-6)
    rec = first["recommendation"]
    assert rec == recommend_cut(first["cuts"], 0.3, 0.02)
    good = [i for i, c in enumerate(first["cuts"]) if qualifies(c, 0.3, 0.02)]
    if good:
        assert rec["cut_index"] == min(good, key=lambda i: first["cuts"][i]["flops"])
    else:
        assert rec["cut"] is None and "accuracy" in rec["reason"]


def test_recommendation_is_the_cheapest_qualifying_cut_or_says_what_would_qualify():
    def cut(name, flops, bound, loss, violated=()):
        return {
            "name": name,
            "op": "Conv",
            "params": 1,
            "flops": flops,
            "bytes_sent": 4,
            "noise_sigma": 1.0,
            "sigma_source": "--noise-sigma",
            "bounds": {"van_trees_mse": bound, "violated_by": list(violated)},
            "utility": {"loss": loss, "accuracy": 0.9 - loss, "clean_accuracy": 0.9},
        }

    cuts = [cut("a", 10, 0.01, 0.0), cut("b", 20, 0.05, 0.3), cut("c", 30, 0.05, 0.01), cut("d", 40, 0.05, 0.0)]
    rec = recommend_cut(cuts, 0.05, 0.02)
    assert (rec["cut"], rec["cut_index"], rec["flops"]) == ("c", 2, 30)  # a misses the bound, b loses too much
    assert recommend_cut([cut("e", 5, 0.05, 1 - 0.98)], 0.05, 0.02)["cut"] == "e"  # a loss at the budget is in it
    rec = recommend_cut(cuts[:2], 0.05, 0.02)
    assert rec["cut"] is None and "allow --max-accuracy-loss 0.3" in rec["reason"]
    rec = recommend_cut([cut("c", 30, 0.05, 0.01, ["decoder"])], 0.05, 0.02)
    assert rec["cut"] is None and "beaten" in rec["reason"]
    rec = recommend_cut(cuts[:1], 0.05, 0.02)
    assert rec["cut"] is None and "add more noise" in rec["reason"]


class _Whole(nn.Module):
    """The small ResNet stem (conv 7x7/2, BatchNorm, ReLU, MaxPool, two residual blocks) with a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = build("resnet", width=4, blocks=2, in_channels=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stem(x).mean((2, 3)))


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """A briefly trained whole ResNet-style model on 16x16 images of three classes (bright half)."""
    torch.manual_seed(0)
    y = torch.arange(240) % 3
    x = 0.3 * torch.rand(240, 1, 16, 16)
    x[y == 0, :, :8] += 0.5
    x[y == 1, :, 8:] += 0.5
    x[y == 2, :, :, :8] += 0.5
    model = _Whole()
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(15):
        optimizer.zero_grad()
        F.cross_entropy(model.train()(x), y).backward()
        optimizer.step()
    folder = tmp_path_factory.mktemp("resnet")
    np.savez(folder / "images.npz", x=x.numpy(), y=y.numpy())
    path = export_onnx(model.eval(), x[:2], folder / "resnet.onnx", exporter="legacy", opset=17)
    return path, folder / "images.npz", x[:32].numpy()


def _brute_force_cuts(proto, input_name: str, output_name: str) -> set[str]:
    """Tensors whose removal disconnects the output from the input's values (Shape/Size carry none)."""
    nodes = [n for n in proto.graph.node if n.op_type not in ("Shape", "Size")]

    def reachable(removed: str) -> bool:
        seen, frontier = {input_name}, [input_name]
        while frontier:
            tensor = frontier.pop()
            for node in nodes:
                if tensor in node.input:
                    for out in node.output:
                        if out not in seen and out != removed:
                            seen.add(out)
                            frontier.append(out)
        return output_name in seen

    tensors = {out for node in nodes for out in node.output} - {output_name}
    return {t for t in tensors if not reachable(t)}


class _Classifier(nn.Module):
    """A stem of tests/support/architectures.py with a classification head on its pooled output."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.stem = build(name, image_size=16, in_channels=1) if name == "vit" else build(name, in_channels=1)
        self.fc = nn.Linear(16 if name in ("vit", "mobilenet") else 8, 3)
        self.tokens = name == "vit"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.stem(x)
        return self.fc(z.mean(1) if self.tokens else z.mean((2, 3)))


@pytest.mark.parametrize(
    "name, exporter", [("resnet", "legacy"), ("resnet", "dynamo"), ("mobilenet", "legacy"), ("vit", "dynamo")]
)
def test_candidates_are_the_dominators_and_the_halves_are_the_model(tmp_path, name, exporter):
    """ResNet-, MobileNet- and ViT-style whole models from both exporters: the candidates are exactly the
    tensors whose removal cuts the output off the input (no tensor inside a residual block), and bottom
    then top reproduces the whole model at every one."""
    x = torch.rand(5, 1, 16, 16)
    path = export_onnx(_Classifier(name).eval(), x[:2], tmp_path / f"{name}.onnx", exporter=exporter, opset=18)
    whole = open_whole_model(path, (1, 16, 16))
    cuts = candidate_cuts(whole)
    names = [c.name for c in cuts]
    assert len(cuts) >= 3 and set(names) == _brute_force_cuts(whole.proto, whole.input_name, whole.output_name)
    assert [c.depth for c in cuts] == sorted(c.depth for c in cuts)
    assert [c.flops for c in cuts] == sorted(c.flops for c in cuts)
    expected = run_onnx(whole.proto, x.numpy())
    for cut in cuts:
        bottom, top = split_at(whole, cut)
        embedding = run_onnx(bottom, x.numpy())
        assert list(embedding.shape[1:]) == cut.shape and cut.bytes_sent == 4 * embedding[0].size
        np.testing.assert_allclose(run_onnx(top, embedding), expected, atol=1e-5)


def test_resnet_cuts_are_the_block_boundaries(resnet):
    whole = open_whole_model(resnet[0], (1, 16, 16))
    names = [c.name for c in candidate_cuts(whole)]
    assert any("layer1.0/Add" in n for n in names) and any("MaxPool" in n for n in names)
    assert not [n for n in names if "layer1.0/conv" in n or "layer1.1/conv" in n]  # inside a residual block


@pytest.mark.slow
def test_cuts_cli_on_a_resnet_recommends_from_its_numbers_and_renders(resnet, capsys):
    path, data, _ = resnet
    args = ["cuts", str(path), "--aux", str(data), "--quick", "--prior", "gaussian", "--attacks", "none"]
    code = _exit_code([*args, "--cuts", "2", "--target-mse", "0.02", "--fail-under-mse", "0.02", "--out", "out"])
    document = json.loads(Path("out/cuts.json").read_text())
    assert code == (0 if document["recommendation"]["cut"] else 1)
    assert len(document["cuts"]) == 2 and Path("out/cuts.html").exists() and Path("out/cuts.md").exists()
    rec = document["recommendation"]
    assert rec == recommend_cut(document["cuts"], 0.02, 0.02)
    for cut in document["cuts"]:
        assert cut["utility"]["clean_accuracy"] == pytest.approx(document["whole_accuracy"]["accuracy"], abs=0.01)
    assert "Recommendation:" in capsys.readouterr().out
    assert _exit_code(["render", "out/cuts.json", "--out", "again"]) == 0
    assert Path("again/cuts.html").exists()
    assert _exit_code(["compare", "out/cuts.json", "out/cuts.json"]) == 2  # its cuts are already side by side
    assert "is a cuts.json" in capsys.readouterr().err
    if rec["cut"] is not None:  # a tampered recommendation is refused on render
        document["recommendation"]["cut_index"] = 1 - rec["cut_index"]
        Path("out/cuts.json").write_text(json.dumps(document))
        assert _exit_code(["render", "out/cuts.json"]) == 2
        assert "contradicts itself" in capsys.readouterr().err


def test_bad_cut_names_exit_2_listing_the_candidates(chain, capsys):
    model, _, aux, _ = chain
    assert _exit_code(["cuts", str(model), "--aux", str(aux), "--cuts", "h1,nosuch", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "'nosuch'" in err and "h1, h2" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "model, fragment",
    [
        (sample("digits_cnn.pt"), "takes a whole model as ONNX (.onnx) or a torch.export program"),
        (sample("text_gpt2"), "this is a Hugging Face checkpoint folder (safetensors), cut after block --split-layer"),
        ("garbage.onnx", "is not a valid ONNX model"),
    ],
)
def test_a_whole_model_that_is_no_onnx_graph_exits_2_with_one_line(model, fragment, capsys):
    """A TorchScript archive and a checkpoint folder keep no graph to cut, and a broken .onnx no graph at
    all: one line, exit 2,
    however the input's shape is found (from the graph, not --input-shape)."""
    Path("garbage.onnx").write_bytes(b"not a protobuf")
    assert _exit_code(["cuts", str(model), "--aux", sample("digits.npz"), "--quick"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1 and "internal error" not in err


def test_a_whole_model_that_ends_in_no_class_scores_is_refused_before_any_cut(tmp_path, capsys):
    """Each cut's top is a classifier whose accuracy under noise is the cut's utility: a feature
    extractor has none, so it is refused in one line before a cut is audited (it failed at the
    second cut, suggesting a flag cuts does not take)."""
    stem = build("resnet", width=4)
    x = torch.rand(40, 3, 16, 16)
    path = export_onnx(stem, x[:2], tmp_path / "stem.onnx", exporter="legacy")
    np.savez(tmp_path / "data.npz", x=x.numpy(), y=(x.mean(dim=(1, 2, 3)) > 0.5).long().numpy())
    args = ["cuts", str(path), "--aux", str(tmp_path / "data.npz"), "--quick", "--out", str(tmp_path / "out")]
    assert _exit_code(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "splitaudit cuts takes a whole classifier" in err
    assert "cuts done" not in err and not (tmp_path / "out" / "cuts.json").exists()


@pytest.mark.parametrize("sliced", [False, True])
def test_a_top_that_reads_the_input_s_shape_gets_it_from_the_cut(tmp_path, sliced):
    """Dynamic-batch exports read the batch size off the input (Shape(x)) to reshape downstream: that
    path carries no values, so h is still a cut, and the top computes the same shape from h."""
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32), "w")
    shape_nodes = (
        [
            helper.make_node("Shape", ["x"], ["batch"], start=0, end=1),
            helper.make_node("Constant", [], ["rest"], value=helper.make_tensor("r", TensorProto.INT64, [1], [4])),
            helper.make_node("Concat", ["batch", "rest"], ["shape"], axis=0),
        ]
        if sliced
        else [helper.make_node("Shape", ["x"], ["shape"])]
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        *shape_nodes,
        helper.make_node("Reshape", ["r", "shape"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "reads_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4])],
        [w],
    )
    path = tmp_path / "shape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    whole = open_whole_model(path, (4,))
    cuts = candidate_cuts(whole)
    assert [c.name for c in cuts] == ["h", "r"]
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    for cut in cuts:
        bottom, top = split_at(whole, cut)
        assert "x" not in {i for node in top.graph.node for i in node.input}
        np.testing.assert_allclose(run_onnx(top, run_onnx(bottom, x)), run_onnx(whole.proto, x), atol=1e-6)


def test_a_torch_export_program_is_cut_in_its_graph_under_its_node_names(tmp_path):
    """A .pt2 whole model: its graph written as ONNX (checked against the program on the data), cut
    under the names of the program's FX nodes (as torch.onnx.export keeps them)."""
    model = _Classifier("resnet").eval()
    x = torch.rand(40, 1, 16, 16)
    batch = torch.export.Dim("batch", min=1, max=4096)
    torch.export.save(torch.export.export(model, (x[:2],), dynamic_shapes=({0: batch},)), tmp_path / "whole.pt2")
    with torch.no_grad():
        np.savez(tmp_path / "data.npz", x=x.numpy(), y=model(x).argmax(1).numpy())
    options = AuditOptions(model=str(tmp_path / "whole.pt2"), aux=str(tmp_path / "data.npz"), quick=True)
    document = run_cuts(replace(options, prior="gaussian", attacks=["none"], cuts=["2"]).validate())
    assert document["model"]["format"] == "exported" and document["whole_accuracy"]["accuracy"] == 1.0
    # the labels are one class (2) of three: the top model's accuracy is read against class 2 too
    assert [c["utility"]["clean_accuracy"] for c in document["cuts"]] == [1.0, 1.0]
    names = [c["name"] for c in document["model"]["candidates"]]
    program_nodes = {n.name for n in torch.export.load(tmp_path / "whole.pt2").graph.nodes}
    assert "relu" in names and "relu" in program_nodes  # the program's node names, as torch.onnx.export keeps them
    assert [c["name"] for c in document["cuts"]] == [names[0], names[-1]]


def _without_times(value):
    """A document's numbers without wall times, dates and where it ran (run, provenance's options)."""
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k not in ("seconds", "run", "started", "ended")}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


@pytest.mark.slow
def test_cuts_on_two_worker_processes_give_the_numbers_of_one_process(chain, capsys):
    """Each cut is one task: on two spawned workers (each cut rebuilt there from the recipe) the
    document's numbers, attacks included, are those of the run in this process, bit for bit."""
    model, _, aux, target = chain
    args = ["cuts", str(model), "--aux", str(aux), "--target", str(target), "--quick", "--prior", "gaussian"]
    args += ["--attacks", "kmeans,attribute", "--target-mse", "0.3"]
    assert _exit_code([*args, "--out", "one"]) in (0, 1)
    assert _exit_code([*args, "--workers", "2", "--out", "two"]) in (0, 1)
    err = capsys.readouterr().err
    one, two = (json.loads(Path(f"{out}/cuts.json").read_text()) for out in ("one", "two"))
    assert (one["run"]["workers"], two["run"]["workers"]) == (1, 2)
    assert {t["worker"] for t in two["run"]["cut_tasks"]} != {"local"}  # ran in the worker processes
    assert [t["cut"] for t in two["run"]["cut_tasks"]] == ["h1", "h2"]
    assert one.pop("provenance")["fingerprint"] == two.pop("provenance")["fingerprint"]  # the same files
    assert _without_times(one) == _without_times(two)
    assert "in 2 local worker processes: h1, h2" in err


def test_the_plan_is_said_before_any_cut_runs_and_each_cut_as_it_ends(chain, monkeypatch):
    from splitaudit.engine import cut_tasks

    model, _, aux, target = chain
    lines: list[str] = []
    audit_cut = cut_tasks.audit_cut
    monkeypatch.setattr(
        cut_tasks, "audit_cut", lambda space, cut: lines.append(f"START {cut.name}") or audit_cut(space, cut)
    )
    run_cuts(
        _options(model, aux, target, prior="gaussian", attacks=["none"], cut_noise_sigma=SIGMA), on_cost=lines.append
    )
    assert lines[0].startswith("auditing 2 of 2 candidate cuts in this process: h1, h2")
    assert lines[1:3] == ["START h1", lines[2]] and lines[2].startswith("cut 1 of 2 done in ")
    assert lines[3] == "START h2" and lines[4].startswith("cut 2 of 2 done in ") and ": h2 (noise sigma 0.5" in lines[4]


def test_the_up_front_estimate_adds_each_cut_to_the_prior_trained_once_and_shares_cuts_over_workers():
    """Each cut's stages as timed on its bottom (dFIL 10, 20, 40 s here), the prior (100 s) once: in
    one process 100 + 70 s; on two workers the work (35 s each) is less than the dearest cut alone,
    so 100 + 40 s; on a busy machine whose timed steps got a quarter of their threads, 4x that."""
    from splitaudit.engine.cuts import _plan_words
    from splitaudit.inputs.onnx_cuts import CutPoint
    from splitaudit.stages.cost import CostEstimate

    cuts = [CutPoint(f"c{k}", "Conv", k, [1], 1, flops, 4) for k, flops in enumerate((100, 200, 400))]
    estimates = [CostEstimate(stages={"dFIL": 10.0, "prior (ssm)": 100.0}, not_estimated=["sdar"])]
    estimates += [CostEstimate(stages={"dFIL": seconds}) for seconds in (20.0, 40.0)]
    words = _plan_words(cuts, 9, 1, estimates)
    assert words.startswith("auditing 3 of 9 candidate cuts in this process: c0, c1, c2; ")
    assert words.endswith(
        "the cuts 10 s, 20 s, 40 s (opening its bottom, dFIL and attacks), so about 3 min in all; not estimated: sdar"
    )
    assert "so about 2 min in all;" in _plan_words(cuts, 9, 2, estimates)  # 140 s
    estimates[1].busy, estimates[1].share = "load average 8", 0.25
    assert "about 3 min in all (at this load about 11 min)" in _plan_words(cuts, 9, 1, estimates)  # 680 s
    words = _plan_words(cuts, 9, 0, None)
    assert "cuts on Ray: c0, c1, c2" in words and "no cost estimate" in words


def test_the_plan_is_timed_on_every_chosen_bottom_before_the_first_cut_runs(chain, monkeypatch):
    from splitaudit.engine import cut_tasks
    from splitaudit.stages import cost

    model, _, aux, target = chain
    monkeypatch.setattr(cost, "worth_estimating", lambda ctx: True)  # the chain's data is too small to be worth it
    timed, lines = [], []
    estimate_cost = cost.estimate_cost
    monkeypatch.setattr(
        cost,
        "estimate_cost",
        lambda ctx, *a, **k: timed.append(ctx.encoder.output_shape) or estimate_cost(ctx, *a, **k),
    )

    def no_cut(space, cut):
        raise RuntimeError("a cut ran")

    monkeypatch.setattr(cut_tasks, "audit_cut", no_cut)
    with pytest.raises(RuntimeError, match="cut 'h1' failed after 1 attempt.*a cut ran"):
        run_cuts(_options(model, aux, target, prior="gaussian", attacks=["none"]), on_cost=lines.append)
    assert timed == [(5,), (4,)]  # h1's bottom, then h2's, before any cut ran
    assert lines[0].startswith("auditing 2 of 2 candidate cuts in this process: h1, h2; timed on each bottom: ")


def test_cuts_json_records_provenance_and_verify_checks_and_remeasures_it(chain, capsys):
    model, _, aux, target = chain
    args = ["cuts", str(model), "--aux", str(aux), "--target", str(target), "--quick", "--prior", "gaussian"]
    assert (
        _exit_code([*args, "--attacks", "none", "--noise-sigma", str(SIGMA), "--out", "out", "--format", "json,md"])
        == 0
    )
    document = json.loads(Path("out/cuts.json").read_text())
    provenance = document["provenance"]
    assert [f["role"] for f in provenance["files"]] == ["model", "aux", "target"]  # the whole model, not a half
    assert provenance["command_line"][:3] == ["splitaudit", "cuts", str(model)]
    assert f"fingerprint `{provenance['fingerprint']}`" in Path("out/cuts.md").read_text()
    capsys.readouterr()
    assert _exit_code(["verify", "out/cuts.json", "--recompute"]) == 0
    out = capsys.readouterr().out
    for cut in document["cuts"]:
        assert f"cut {cut['name']!r}: dFIL at sigma {SIGMA:g} measures" in out
    assert out.count("inside the report's interval") == 2 and "verified: 3 file(s) match report fingerprint" in out
    data = dict(np.load(aux))
    np.savez(aux, x=data["x"] + 1e-3, y=data["y"])
    assert _exit_code(["verify", "out/cuts.json"]) == 1
    assert "aux" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--split-layer", "2"], ["--task-timeout", "5"]])
def test_cuts_does_not_offer_options_that_mean_nothing_there(chain, capsys, flag):
    model, _, aux, _ = chain
    assert _exit_code(["cuts", str(model), "--aux", str(aux), *flag]) == 2
    assert "No such option" in capsys.readouterr().err
