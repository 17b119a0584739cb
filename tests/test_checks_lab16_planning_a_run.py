"""Lab 16's checks: right answers pass; each usual mistake gets the hint that names it.

The memory answers are compared with the bytes that one process held here and that every rank
held on meshes of a real 4-engine cluster (Gloo); the coordinates and groups with torch's
``init_device_mesh`` on the same cluster and with ``course_lib.mesh`` on larger meshes. The
wrong answers below are written as a student would write them, apart from the check's own
count of each mistake."""

import math
import re

import numpy as np
import pytest
import torch

from course_lib import mesh as M
from course_lib import planner
from course_lib import transformer as tf
from course_lib.checks import CheckFailed
from course_lib.checks import lab16_planning_a_run as checks

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py


# ---------------------------------------------------------------- memory answers
def memory(cfg, layout, batch, length, *, s=8, ints=8, counter=4, mask_bytes=1, emb_tp=False,
           ln_tp=False, bias_tp=False, hidden=None, pos_by_length=False, untied=False,
           mlp_biases=True, grad_dp=False,
           opt_dp=False, adam=2, counters=True, per_parameter=False, ln_act_tp=False,
           no_dp=False, total_dp=False, cp_dense=False, ring_extras=True, keep_core=False,
           ignore_full=False, full_tp=False, head=True, logprobs=True, logits=False,
           stats=True, positions=True, blocks=None, logprobs_tp=False, mask_per_head=False,
           mask_tp=False, whole_keys=False, loss=True, hidden_4d=False):
    """A from-scratch count with knobs that turn it into the usual mistakes."""
    V, d, h, L = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers
    H = 4 * d if hidden_4d else (hidden or cfg.hidden or 4 * d)
    tp, dp, cp = layout.tp, layout.dp, layout.cp
    outside = (V * d + (length if pos_by_length else cfg.context) * d + 2 * d) / \
        (tp if emb_tp else 1)
    norms = L * 4 * d / (tp if ln_tp else 1)
    biases = L * (2 * d if mlp_biases else d) / (tp if bias_tp else 1)
    matrices = L * (3 * d * d + 3 * d + d * d + d * H + (H if mlp_biases else 0) + H * d) / tp
    n = outside + norms + biases + matrices + (V * d if untied else 0)
    tensors = 4 + 12 * L
    step = (counter * (n if per_parameter else tensors)) if counters else 0

    b = batch if (no_dp or total_dp) else batch // dp
    T = length // cp
    ring = cp > 1 and not cp_dense
    recompute = None if (ignore_full and cfg.recompute == "full") else cfg.recompute
    if recompute == "full":
        block = b * T * d * s / (tp if full_tp else 1)
    else:
        ln = tp if ln_act_tp else 1
        block = (4 * b * T * d + (4 * b * T if stats else 0)) * s / ln
        block += (3 * b * T * d + b * T * d + 2 * b * T * H) * s / tp
        if recompute != "attention" or keep_core:
            if ring:
                block += (b * T * d + b * h * T) * s / tp if ring_extras else 0
            if not ring or whole_keys:
                keys = length if whole_keys else T
                mask = T * keys * mask_bytes * (b * h / tp if mask_per_head else 1)
                block += b * h * T * keys * s / tp + mask / (tp if mask_tp else 1)
    top = 0
    if head:
        top = (2 * b * T * d + 2 * b * T + (b * T * V / (tp if logprobs_tp else 1) if logprobs
                                            else 0) + (1 if loss else 0)) * s
        top += 2 * b * T * ints + (T * ints if positions else 0)
        top += b * T * V * s if logits else 0
    activations = (blocks or L) * block + top
    if total_dp:
        activations /= dp
    return {"parameters": n * s, "gradients": n * s / (dp if grad_dp else 1),
            "optimizer": adam * n * s / (dp if opt_dp else 1) + step,
            "activations": activations}


def solution(cfg, layout, batch, length):
    """The lab's solution, as in labs/solutions/16_planning_a_run.ipynb."""
    V, d, h, L = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers
    H = cfg.hidden or 4 * d
    tp, s = layout.tp, 8
    whole = V * d + cfg.context * d + 2 * d + L * (4 * d + 2 * d)
    split = L * (3 * d * d + 3 * d + d * d + d * H + H + H * d) / tp
    n = whole + split
    tensors = 4 + 12 * L
    b, T = batch // layout.dp, length // layout.cp
    if cfg.recompute == "full":
        block = b * T * d * s
    else:
        block = s * (4 * b * T * d + 4 * b * T)
        block += s * (3 * b * T * d + b * T * d + 2 * b * T * H) / tp
        if cfg.recompute != "attention":
            if layout.cp > 1:
                block += s * (b * T * d + b * h * T) / tp
            else:
                block += s * b * h * T * T / tp + T * T
    head = s * (2 * b * T * d + 2 * b * T + b * T * V + 1) + 8 * (2 * b * T + T)
    return {"parameters": n * s, "gradients": n * s, "optimizer": 2 * n * s + 4 * tensors,
            "activations": L * block + head}


def with_total(cfg, layout, batch, length):
    out = memory(cfg, layout, batch, length)
    return {**out, "total": sum(out.values())}


@pytest.mark.parametrize("fn", [solution, memory, with_total, checks.reference_memory])
def test_right_memory_answers_pass(cluster, fn, capsys):
    assert checks.check_memory(fn, cluster) is True
    assert "✓ check_memory: 12/12 configurations match the bytes held (4 in this kernel, 8 " \
           "meshes on the cluster's 4 ranks: 36 ranks in all)" in capsys.readouterr().out


def test_memory_not_implemented_is_reported_not_raised(cluster, capsys):
    def todo(cfg, layout, batch, length):
        raise NotImplementedError("exercise 1: fill in my_memory")
    assert checks.check_memory(todo, cluster) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("knobs, hint", [
    (dict(s=1, ints=1, counter=1), r"(?s)case 1/12 .*you counted numbers, not bytes"),
    (dict(s=4), r"float64 here: 8 bytes a number, not 4"),
    (dict(emb_tp=True), r"(?s)case 5/12 \(mesh dp2 x tp2.*parameters: rank 0 of 4 held 62,080 "
                        r"bytes.*divided the embeddings"),
    (dict(ln_tp=True), r"divided the blocks' LayerNorms by tp"),
    (dict(bias_tp=True), r"divided the row-parallel biases"),
    (dict(emb_tp=True, ln_tp=True, bias_tp=True), r"you divided every parameter by tp"),
    (dict(mlp_biases=False), None),  # no usual mistake: the parts of the count, below
    (dict(pos_by_length=True), r"(?s)case 2/12 .*cfg\.context, whatever the length"),
    (dict(untied=True), r"tied: logits = LN\(x\) @ tok\.weight\.T"),
    (dict(grad_dp=True), r"(?s)gradients: .*that is ZeRO-2"),
    (dict(opt_dp=True), r"(?s)optimizer: .*that is ZeRO-1"),
    (dict(adam=1), r"Adam keeps two numbers per parameter"),
    (dict(adam=0), r"the step counters but not Adam's two numbers"),
    (dict(adam=3), r"mixed precision's master copy"),
    (dict(counters=False), r"a step counter for each parameter tensor: a float32 scalar"),
    (dict(counter=8), r"step counters are float32 scalars, 4 bytes"),
    (dict(per_parameter=True), r"one step counter per parameter tensor, not per number"),
    (dict(ln_act_tp=True), r"(?s)case 5/12 .*activations: .*divided the LayerNorm regions by tp"),
    (dict(no_dp=True), r"(?s)case 5/12 .*holds B / dp of the sequences"),
    (dict(total_dp=True), r"(?s)case 5/12 .*divided the activations of the whole batch by dp"),
    (dict(cp_dense=True), r"(?s)case 8/12 \(mesh cp2 x tp2.*ring attention \(cp > 1\) keeps no "
                          r"probabilities and no mask"),
    (dict(ring_extras=False), r"(?s)case 8/12 .*its output a second time .* the log-denominators"),
    (dict(keep_core=True), r"(?s)case 3/12 .*selective recomputation \(recompute='attention'\) "
                           r"keeps only attention's inputs"),
    (dict(ignore_full=True), r"(?s)case 4/12 .*'full' keeps each block's input only"),
    (dict(full_tp=True), r"(?s)case 11/12 .*a block keeps its input, b T' d, whole on every tp"),
    (dict(head=False), r"the head is part of every forward"),
    (dict(logprobs=False), r"you left out the log-probabilities over the vocabulary"),
    (dict(logits=True), r"the logits themselves are not kept"),
    (dict(mask_bytes=8), r"the causal mask is booleans: 1 byte each"),
    (dict(blocks=1), r"every block keeps its own activations"),
    (dict(stats=False), r"you left out the LayerNorms' statistics, 4 b T', in each of 2 blocks: "
                        r"8,192 bytes here"),
    (dict(positions=False), r"you left out the positions, T' int64 \(the head\): 128 bytes"),
    # bytes that happen to equal another part here: the probes tell the mistake apart
    (dict(logprobs_tp=True), r"(?s)case 5/12 .*you divided the log-probabilities by tp: the "
                             r"head is not split"),
    (dict(ints=4), r"(?s)case 1/12 .*int64 \(torch's integers by default\): 8 bytes each"),
    (dict(mask_per_head=True), r"one T' x T' boolean tensor a block, shared by every sequence"),
    (dict(mask_tp=True), r"(?s)case 5/12 .*the causal mask is not split by tp"),
    (dict(hidden_4d=True), r"(?s)case 2/12 .*H = cfg.hidden or 4 \* d"),
    (dict(whole_keys=True, ring_extras=False), r"(?s)case 8/12 .*ring attention \(cp > 1\) keeps "
                                               r"no probabilities and no mask"),
    (dict(loss=False), r"you left out the loss, one number \(the head\): 8 bytes here"),
])
def test_usual_memory_mistakes_get_their_hint(cluster, knobs, hint):
    with pytest.raises(CheckFailed) as info:
        checks.check_memory(lambda *a: memory(*a, **knobs), cluster)
    message = str(info.value)
    assert "Hint:" in message
    if hint is None:  # no usual mistake fits: the parts of the count, to compare with
        assert "made of:" in message and "the MLP's first weight and bias" in message, message
        assert "yours is -1,280 bytes off" in message, message  # 2 blocks x (H + d) x 8
    else:
        assert re.search(hint, message), message


def test_other_memory_answers_are_described(cluster):
    def a_list(cfg, layout, batch, length):
        return list(memory(cfg, layout, batch, length).values())

    def a_string(cfg, layout, batch, length):
        return {**memory(cfg, layout, batch, length), "optimizer": "16 bytes a parameter"}

    def wrong_total(cfg, layout, batch, length):
        return {**memory(cfg, layout, batch, length), "total": 0}

    def crashes(cfg, layout, batch, length):
        return cfg["d_model"]

    for fn, hint in [(a_list, r"return a dict with the keys \['parameters'"),
                     (a_string, r"every kind is a number of bytes"),
                     (wrong_total, r"the total, if you return one, adds up the four kinds"),
                     (crashes, r"(?s)raised TypeError.*read by attribute \(cfg\.d_model")]:
        with pytest.raises(CheckFailed, match=hint):
            checks.check_memory(fn, cluster)


def test_the_count_is_the_planners_where_the_planner_counts_the_mlp_as_4d():
    cases = [(cfg, planner.Layout(), b, t) for _, cfg, b, t in checks.ONE_PROCESS_CASES
             if cfg.hidden is None]
    cases += [(checks.mesh_config(checks.MESH_LENGTH, recompute), planner.Layout(**shape),
               checks.MESH_BATCH, checks.MESH_LENGTH) for shape, recompute in checks.MESH_CASES]
    for case in cases:
        plan = planner.memory_per_rank(*case)
        assert {k: plan[k] for k in checks.KINDS} == checks.reference_memory(*case), case


def test_every_usual_mistake_shows_in_some_case(cluster):
    """No mistake of the list is dead: each changes some kind of some case, and the first case
    where it shows gets its own hint, or that of a mistake that gives the same bytes there."""
    cases = checks.measured_cases(cluster)
    for mistake in [*checks.MISTAKES, *checks.SAME_AS]:
        for _, cfg, layout, batch, length, _held in cases:
            right = checks.reference_memory(cfg, layout, batch, length)
            wrong = checks.reference_memory(cfg, layout, batch, length, mistake)
            kind = next((k for k in checks.KINDS if abs(wrong[k] - right[k]) >= 0.5), None)
            if kind is not None:
                hint = checks.diagnose_memory(cfg, layout, batch, length, kind, wrong)
                named = [m for m in [*checks.MISTAKES, *checks.SAME_AS]
                         if checks.MISTAKES[checks.SAME_AS.get(m, m)] == hint]
                assert any(checks.reference_memory(cfg, layout, batch, length, m) == wrong
                           for m in named), (mistake, cfg, layout, kind, hint)
                break
        else:
            pytest.fail(f"the mistake {mistake!r} changes no case")


def test_the_check_needs_four_engines():
    class Two:
        n = 2
    with pytest.raises(ValueError, match="a cluster of 4 engines"):
        checks.check_memory(solution, Two())
    with pytest.raises(ValueError, match="a cluster of 4 engines"):
        checks.check_groups(groups, Two())


# ---------------------------------------------------------------- coordinates and groups
def coordinates(rank, shape, order="C", one_based=False, reverse_names=False, no_modulo=False):
    """From-scratch coordinates with knobs that turn them into the usual mistakes."""
    sizes = list(shape.values())
    if order == "F":
        sizes = sizes[::-1]
    coords, rest = [], rank
    for size in reversed(sizes):
        coords.append(rest if no_modulo else rest % size)
        rest //= size
    coords = coords[::-1]
    if order == "F":
        coords = coords[::-1]
    if reverse_names:
        coords = coords[::-1]
    return {name: c + one_based for name, c in zip(shape, coords, strict=True)}


def groups(rank, shape, order="C", drop_self=False, other=False, sharing=False,
           positions=False, consecutive=False, reverse=False):
    """From-scratch groups with knobs that turn them into the usual mistakes."""
    names, sizes = list(shape), list(shape.values())
    world = math.prod(sizes)
    out = {}
    for i, name in enumerate(names):
        if other:  # the group of the next dimension instead
            name_used = names[(i + 1) % len(names)]
        else:
            name_used = name
        j = names.index(name_used)
        stride = math.prod(sizes[j + 1:]) if order == "C" else math.prod(sizes[:j])
        c = coordinates(rank, shape, order)[name_used]
        g = [rank - c * stride + k * stride for k in range(shape[name_used])]
        if sharing:
            mine = coordinates(rank, shape)[name]
            g = [r for r in range(world) if coordinates(r, shape)[name] == mine]
        if positions:
            g = list(range(shape[name]))
        if consecutive:
            g = [rank // shape[name] * shape[name] + k for k in range(shape[name])]
        if drop_self:
            g = [r for r in g if r != rank]
        if reverse:
            g = g[::-1]
        out[name] = g
    return out


def unravelled(rank, shape):
    return dict(zip(shape, map(int, np.unravel_index(rank, tuple(shape.values()))), strict=True))


def library_groups(rank, shape):
    return {name: next(g for g in gs if rank in g) for name, gs in M.mesh_groups(shape).items()}


@pytest.mark.parametrize("fn", [coordinates, unravelled, M.coordinates])
def test_right_coordinates_pass(cluster, fn, capsys):
    assert checks.check_coordinates(fn, cluster) is True
    assert "✓ check_coordinates: every rank of 8 meshes matches (3 against init_device_mesh" in \
        capsys.readouterr().out


@pytest.mark.parametrize("fn", [groups, library_groups])
def test_right_groups_pass(cluster, fn, capsys):
    assert checks.check_groups(fn, cluster) is True
    assert "✓ check_groups: every rank's groups along every dimension of 8 meshes match" in \
        capsys.readouterr().out


def test_mesh_not_implemented_is_reported_not_raised(cluster, capsys):
    def todo(rank, shape):
        raise NotImplementedError("exercise 2: fill in my_coordinates")
    assert checks.check_coordinates(todo, cluster) is False
    assert checks.check_groups(todo, cluster) is False
    assert capsys.readouterr().out.count("not implemented yet") == 2


@pytest.mark.parametrize("knobs, hint", [
    (dict(order="F"), r"(?s)case 1/8 \(init_device_mesh.*my_coordinates\(1, \{'dp': 2, 'tp': "
                      r"2\}\)\n  expected \{'dp': 0, 'tp': 1\}, got \{'dp': 1, 'tp': 0\}.*"
                      r"column-major coordinates"),
    (dict(reverse_names=True), r"(?s)case 1/8 .*column-major"),  # in 2-D, the same numbers
    (dict(one_based=True), r"coordinates count from 0, as ranks do"),
    (dict(no_modulo=True), r"is outside 0 \.\. 1: take it modulo the size"),
])
def test_usual_coordinate_mistakes_get_their_hint(cluster, knobs, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_coordinates(lambda r, s: coordinates(r, s, **knobs), cluster)


def test_coordinates_as_a_list_are_told_to_be_a_dict(cluster):
    with pytest.raises(CheckFailed, match=r"return a dict of the dimension names"):
        checks.check_coordinates(lambda r, s: list(coordinates(r, s).values()), cluster)
    with pytest.raises(CheckFailed, match=r"stride_i the product of the sizes after i"):
        checks.check_coordinates(lambda r, s: {k: 0 for k in s}, cluster)


@pytest.mark.parametrize("knobs, hint", [
    (dict(drop_self=True), r"(?s)case 1/8 .*rank 0 is missing from its own group"),
    (dict(order="F"), r"(?s)along 'dp': expected \[0, 2\], got \[0, 1\].*laid out column-major"),
    # in 2-D the group of the other dimension is the column-major one, and the ranks that share
    # a coordinate too: all three named
    (dict(other=True), r"laid out column-major, the first dimension fastest \(it is also its "
                       r"group along 'tp'\)"),
    (dict(sharing=True), r"(?s)along 'dp': expected \[0, 2\], got \[0, 1\].*also its group "
                         r"along 'tp'"),
    (dict(positions=True), r"the positions 0 \.\. 1 within a group"),
    (dict(consecutive=True), r"consecutive ranks form the groups of the last dimension only "
                             r"\('tp'\)"),
    (dict(reverse=True), r"the right ranks in the wrong order"),
])
def test_usual_group_mistakes_get_their_hint(cluster, knobs, hint):
    with pytest.raises(CheckFailed, match=hint) as info:
        checks.check_groups(lambda r, s: groups(r, s, **knobs), cluster)
    assert "Hint:" in str(info.value)


def reordered(d):
    return dict(reversed(list(d.items())))


def divided_by_the_size(rank, shape):
    return {name: rank // size % size for name, size in shape.items()}


def stride_with_its_own_size(rank, shape):
    sizes = list(shape.values())
    return {name: rank // math.prod(sizes[i:]) % sizes[i] for i, name in enumerate(shape)}


@pytest.mark.parametrize("fn, hint", [
    (lambda r, s: reordered(coordinates(r, s)),
     r"(?s)case 1/8 .*my_coordinates\(0, \{'dp': 2, 'tp': 2\}\)\n  the right coordinates, but "
     r"keyed \['tp', 'dp'\]: the mesh's dimensions are \['dp', 'tp'\], in that order"),
    (lambda r, s: {name: r % size for name, size in s.items()},
     r"(?s)my_coordinates\(1, .*every coordinate is rank % size: the rank is not divided"),
    (divided_by_the_size, r"(?s)case 1/8 .*divided by the dimension's own size, not by its "
                          r"stride"),
    (stride_with_its_own_size, r"(?s)case 1/8 .*my_coordinates\(1, .*stride_i the product of "
                               r"the sizes after i .*rank 1: \{'dp': 0, 'tp': 1\}"),
    (lambda r, s: {name: (r / math.prod(list(s.values())[i + 1:])) % size
                   for i, (name, size) in enumerate(s.items())},
     r"coordinate 'dp' is 0\.5, not a whole number: / divides into a float"),
    (lambda r, s: list(coordinates(r, s).items()), r"return a dict of the dimension names"),
], ids=["keys in another order", "no division", "divided by the size", "stride with its own size",
        "float division", "pairs"])
def test_more_coordinate_mistakes(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_coordinates(fn, cluster)


def every_group(rank, shape):
    return {name: [g for g in gs] for name, gs in M.mesh_groups(shape).items()}


def from_the_rank(rank, shape):
    sizes = list(shape.values())
    return {name: [rank + j * math.prod(sizes[i + 1:]) for j in range(sizes[i])]
            for i, name in enumerate(shape)}


def group_stride_with_its_own_size(rank, shape):
    sizes, out = list(shape.values()), {}
    for i, name in enumerate(shape):
        stride = math.prod(sizes[i:])  # one size too many: the group's own
        c = rank // stride % sizes[i]
        out[name] = [rank - c * stride + j * stride for j in range(sizes[i])]
    return out


@pytest.mark.parametrize("fn, hint", [
    (lambda r, s: reordered(groups(r, s)), r"the right groups, but keyed \['tp', 'dp'\]"),
    (group_stride_with_its_own_size, r"(?s)case 1/8 .*along 'dp': expected \[0, 2\], got "
                                     r"\[0, 4\].*rank 4 is outside the mesh"),
    (every_group, r"along 'dp': expected \[0, 2\], got \[\[0, 2\], \[1, 3\]\]\nHint: that is "
                  r"every group along 'dp': return only the one that holds rank 0"),
    (lambda r, s: groups(0, s), r"(?s)my_groups\(1, .*that is rank 0's group along 'dp', "
                                r"whatever the rank"),
    (from_the_rank, r"(?s)my_groups\(1, .*the group starts at rank 1 itself"),
    (lambda r, s: {n: [x + M.coordinates(r, s)[n] * 0 + 100 for x in g]
                   for n, g in groups(r, s).items()}, r"rank 100 is outside the mesh"),
    (lambda r, s: {n: tuple(float(x) for x in g) for n, g in groups(r, s).items()}, None),
], ids=["keys in another order", "stride with its own size", "every group", "rank 0's for all",
        "starts at the rank", "outside the mesh", "floats in a tuple (right)"])
def test_more_group_mistakes(cluster, fn, hint):
    if hint is None:
        assert checks.check_groups(fn, cluster) is True
        return
    with pytest.raises(CheckFailed, match=hint):
        checks.check_groups(fn, cluster)


def test_sharing_a_coordinate_is_named_where_it_is_no_other_group(cluster):
    """In 3-D the ranks that share a coordinate are no dimension's group: named as such."""
    def sharing_in_3d(rank, shape):
        right = groups(rank, shape)
        return right if len(shape) < 3 or 1 in shape.values() else groups(rank, shape,
                                                                          sharing=True)
    with pytest.raises(CheckFailed, match=r"(?s)case 4/8 .*share rank 0's coordinate along "
                                          r"'dp'"):
        checks.check_groups(sharing_in_3d, cluster)


def test_a_group_along_another_dimension_is_named_in_3d(cluster):
    def other_in_3d(rank, shape):
        return groups(rank, shape, other=len(shape) == 3 and 1 not in shape.values())
    with pytest.raises(CheckFailed, match=r"(?s)case 4/8 .*along 'dp': expected \[0, 4\], got "
                                          r"\[0, 2\].*that is rank 0's group along 'cp', not "
                                          r"along 'dp'"):
        checks.check_groups(other_in_3d, cluster)


def test_the_measured_mesh_is_torchs_and_the_librarys(cluster):
    cases = checks.mesh_cases(cluster)
    assert [c[1] for c in cases] == checks.TORCH_SHAPES + checks.LIBRARY_SHAPES
    for _, shape, ranks in cases:
        assert ranks == [checks.library_mesh(r, shape) for r in range(math.prod(shape.values()))]
    assert tf.GPTConfig(context=16, d_model=16, n_heads=4) == checks.mesh_config(16, None)


# ---------------------------------------------------------------- exercise 3: FP8 per block
def _to_fp8_blocks(mistake=None):
    def to_fp8_blocks(x, block):
        blocks = x.float().unflatten(-1, (-1, block))
        if mistake == "one scale for the tensor":
            amax = x.abs().max().expand(blocks.shape[:-1]).unsqueeze(-1)
        elif mistake == "max without abs":
            amax = blocks.amax(-1, keepdim=True)
        else:
            amax = blocks.abs().amax(-1, keepdim=True)
        scales = 448 / amax if mistake == "upside down" else amax / 448
        if mistake != "no clamp":
            scales = scales.clamp(min=torch.finfo(torch.float32).tiny)
        q = (blocks / scales).to(torch.float8_e4m3fn).flatten(-2)
        if mistake == "floats":
            q = q.float()
        return q, scales.squeeze(-1)
    return to_fp8_blocks


def test_fp8_check_passes_the_answer(capsys):
    assert checks.check_to_fp8_blocks(_to_fp8_blocks())
    assert "6/6 tensors" in capsys.readouterr().out


def test_fp8_check_returns_false_until_implemented():
    def to_fp8_blocks(x, block):
        raise NotImplementedError
    assert checks.check_to_fp8_blocks(to_fp8_blocks) is False


@pytest.mark.parametrize("mistake, hint", [
    ("one scale for the tensor", "every block has the tensor's scale"),
    ("max without abs", "largest *magnitude*"),
    ("upside down", "the scale is upside down"),
    ("no clamp", "a block of zeros has amax 0"),
    ("floats", "expected torch.float8_e4m3fn"),
])
def test_fp8_check_names_the_mistake(mistake, hint):
    with pytest.raises(CheckFailed) as failed:
        checks.check_to_fp8_blocks(_to_fp8_blocks(mistake))
    assert hint in str(failed.value)
