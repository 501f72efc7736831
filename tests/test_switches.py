"""Switch files and switch resolution: every rule of SPEC §3, file against CLI included."""

from __future__ import annotations

import json
from pathlib import Path

import onnx_ir as ir
import pytest

from fusectl.core.plugins import load_builtin_passes
from fusectl.core.switches import (
    Plan,
    Source,
    SwitchRequest,
    parse_optimization_switch,
    parse_switch_file,
    resolve,
    split_pass_list,
)
from fusectl.errors import FusectlError
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.registry import (
    Category,
    FusionPass,
    PassRegistry,
    PassSpec,
)

G, U = Category.GRAPH, Category.UB


def _pass(spec: PassSpec) -> FusionPass:
    class Declared(FusionPass):
        def run(self, model: ir.Model, ctx: PassContext) -> None:
            raise AssertionError("resolution tests never run passes")

    Declared.spec = spec
    return Declared()


@pytest.fixture
def registry() -> PassRegistry:
    """A catalogue shaped like the real one: graph and UB passes, aliases, defaults, required."""
    reg = PassRegistry()
    for spec in (
        PassSpec("ConvBatchnormFusionPass", G, "conv+bn", priority=4060),
        PassSpec("AABiasaddConvFusion", G, "conv+add", aliases=("conv_bias_add",), priority=4010),
        PassSpec(
            "MatMulBiasAddFusionPass",
            G,
            "matmul+add",
            aliases=("matmul_elem_biasadd_fusion",),
            priority=5120,
        ),
        PassSpec("SoftmaxFusionPass", G, "softmax"),
        PassSpec("ExperimentalFusionPass", G, "off by default", default_on=False),
        PassSpec("ConvActivationFusionPass", U, "conv+act", targets=("ort",), emits=("FusedConv",)),
        PassSpec(
            "AddLayerNormFusionPass",
            U,
            "add+ln",
            aliases=("add_layer_norm_fusion",),
            targets=("ort",),
            emits=("SkipLayerNormalization",),
        ),
        PassSpec("DeadNodeEliminationPass", G, "dce", closable=False, required=True, counted=False),
    ):
        reg.register(_pass(spec))
    return reg


def write(tmp_path: Path, text: str, name: str = "switch.cfg") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def plan_for(registry: PassRegistry, **kwargs: object) -> Plan:
    return resolve(registry, SwitchRequest(**kwargs))  # type: ignore[arg-type]


def state(plan: Plan, name: str) -> tuple[bool, Source]:
    decision = next(d for d in plan.decisions if d.name == name)
    return decision.enabled, decision.source


def json_file(tmp_path: Path, document: dict) -> Path:
    return parse_switch_file(write(tmp_path, json.dumps(document)))


# --- parsing --------------------------------------------------------------------------------


def test_json_file_sections_are_separate_namespaces(tmp_path: Path) -> None:
    parsed = json_file(
        tmp_path, {"Switch": {"GraphFusion": {"A": "on", "ALL": "off"}, "UBFusion": {"B": "off"}}}
    )
    assert not parsed.legacy
    assert parsed.entries == {G: {"A": True, "ALL": False}, U: {"B": False}}


def test_legacy_lines_apply_to_both_categories(tmp_path: Path) -> None:
    parsed = parse_switch_file(write(tmp_path, "A:off\r\n\n  B : on \n# note\n"))
    assert parsed.legacy
    assert parsed.entries == {G: {"A": False, "B": True}, U: {"A": False, "B": True}}


def test_values_and_keys_are_trimmed_consistently(tmp_path: Path) -> None:
    parsed = json_file(tmp_path, {"Switch": {"GraphFusion": {" A ": " on"}}})
    assert parsed.entries[G] == {"A": True}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"Switch": {"GraphFusion": {"A": "on",}}}',
            "invalid JSON at line 1, column 39: Expecting property name",
        ),
        ('{\n  "Switch": {\n    "GraphFusion": {"A": "on"\n}', "invalid JSON at line 4"),
        ("[1, 2]", "top level is a JSON list, it must be an object"),
        ('{"Swtich": {}}', "first-level key 'Swtich' is not one of Switch"),
        ('{"Switch": {"Graph": {}}}', "key 'Switch.Graph' is not valid"),
        ('{"Switch": {"GraphFusion": []}}', "'Switch.GraphFusion' must be an object"),
        ('{"Switch": {"GraphFusion": {"A": "On"}}}', "value of 'Switch.GraphFusion.A' is \"On\""),
        ('{"Switch": {"GraphFusion": {"A": false}}}', 'must be the string "on" or "off"'),
        ('{"Priority": {"GraphFusion": {"Middle": {}}}}', "must be Top, Main or Down"),
        ('{"Priority": {"GraphFusion": {"Top": {"A": "1000"}}}}', "in [0, 1000)"),
        ('{"Priority": {"GraphFusion": {"Top": {"A": "x"}}}}', "must be an integer"),
        (
            '{"Priority": {"GraphFusion": {"Top": {"A": "1"}, "Main": {"A": "1001"}}}}',
            "pass 'A' has more than one priority",
        ),
        ('{"ExceptionalPassOfO1Level": "A"}', "must be an array"),
        ("A:on\nB\n", "line 2: 'B' is not 'PassName:on' or 'PassName:off'"),
        ("A:of\n", "line 1: the switch value of pass A must be on or off, instead of 'of'"),
        ("A:on\nA:off\n", "line 2: pass A is repeated"),
        (":on\n", "line 1: pass name is empty"),
        ("  \n\n", "switch file is empty"),
        ("# only a comment\n", "switch file has no entries"),
    ],
)
def test_malformed_switch_files_name_the_file_and_the_problem(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(FusectlError) as raised:
        parse_switch_file(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert message in str(raised.value)


def test_unreadable_switch_files(tmp_path: Path) -> None:
    with pytest.raises(FusectlError, match="switch file does not exist"):
        parse_switch_file(tmp_path / "missing.cfg")
    with pytest.raises(FusectlError, match="switch file is a directory"):
        parse_switch_file(tmp_path)
    binary = tmp_path / "binary.cfg"
    binary.write_bytes(b"\xff\xfe\x00A:on")
    with pytest.raises(FusectlError, match="not UTF-8 text"):
        parse_switch_file(binary)


def test_duplicate_json_keys_warn_and_keep_the_last(tmp_path: Path) -> None:
    parsed = parse_switch_file(
        write(tmp_path, '{"Switch": {"GraphFusion": {"A": "on", "A": "off"}}}')
    )
    assert parsed.entries[G] == {"A": False}
    assert parsed.warnings == ["duplicate key 'A': the last one is used"]


def test_optimization_switch_and_pass_lists() -> None:
    assert parse_optimization_switch("A:on; B:off;") == {"A": True, "B": False}
    with pytest.raises(FusectlError, match="'A=on' is not"):
        parse_optimization_switch("A=on")
    assert split_pass_list(["A,B", " C ", "D,,"]) == ["A", "B", "C", "D"]


# --- resolution -----------------------------------------------------------------------------


def test_defaults_without_any_switch(registry: PassRegistry) -> None:
    plan = plan_for(registry)
    assert state(plan, "SoftmaxFusionPass") == (True, Source.DEFAULT)
    assert state(plan, "ExperimentalFusionPass") == (False, Source.DEFAULT)
    assert state(plan, "DeadNodeEliminationPass") == (True, Source.FORCED)
    assert plan.warnings == [] and plan.notes == []


def test_exact_name_beats_all_in_both_directions(registry: PassRegistry, tmp_path: Path) -> None:
    off = json_file(
        tmp_path, {"Switch": {"GraphFusion": {"ALL": "off", "SoftmaxFusionPass": "on"}}}
    )
    plan = plan_for(registry, switch_file=off)
    assert state(plan, "SoftmaxFusionPass") == (True, Source.FILE)
    assert state(plan, "ConvBatchnormFusionPass") == (False, Source.ALL)
    on = json_file(tmp_path, {"Switch": {"GraphFusion": {"ALL": "on", "SoftmaxFusionPass": "off"}}})
    plan = plan_for(registry, switch_file=on)
    assert state(plan, "SoftmaxFusionPass") == (False, Source.FILE)
    assert state(plan, "ExperimentalFusionPass") == (True, Source.ALL)  # ALL beats the default


def test_all_of_one_category_leaves_the_other_alone(registry: PassRegistry, tmp_path: Path) -> None:
    plan = plan_for(
        registry, switch_file=json_file(tmp_path, {"Switch": {"GraphFusion": {"ALL": "off"}}})
    )
    assert state(plan, "ConvActivationFusionPass") == (True, Source.DEFAULT)
    plan = plan_for(
        registry, switch_file=json_file(tmp_path, {"Switch": {"UBFusion": {"ALL": "off"}}})
    )
    assert state(plan, "ConvActivationFusionPass") == (False, Source.ALL)
    assert state(plan, "ConvBatchnormFusionPass") == (True, Source.DEFAULT)


def test_all_off_keeps_required_passes_and_says_so_in_one_line(
    registry: PassRegistry, tmp_path: Path
) -> None:
    plan = plan_for(
        registry,
        switch_file=json_file(
            tmp_path, {"Switch": {"GraphFusion": {"ALL": "off"}, "UBFusion": {"ALL": "off"}}}
        ),
    )
    assert state(plan, "DeadNodeEliminationPass") == (True, Source.FORCED)
    assert plan.notes == [
        "ALL:off in GraphFusion left 1 required pass(es) on: DeadNodeEliminationPass"
    ]
    assert [d.name for d in plan.enabled()] == ["DeadNodeEliminationPass"]


def test_required_pass_cannot_be_switched_off_by_name(
    registry: PassRegistry, tmp_path: Path
) -> None:
    plan = plan_for(
        registry,
        switch_file=json_file(
            tmp_path, {"Switch": {"GraphFusion": {"DeadNodeEliminationPass": "off"}}}
        ),
        disable=["DeadNodeEliminationPass"],
    )
    assert state(plan, "DeadNodeEliminationPass") == (True, Source.FORCED)
    assert plan.warnings == ["pass DeadNodeEliminationPass is required and cannot be switched off"]


def test_cli_beats_the_file(registry: PassRegistry, tmp_path: Path) -> None:
    file = json_file(
        tmp_path,
        {
            "Switch": {
                "GraphFusion": {
                    "SoftmaxFusionPass": "off",
                    "ConvBatchnormFusionPass": "on",
                    "ALL": "off",
                }
            }
        },
    )
    plan = plan_for(
        registry,
        switch_file=file,
        enable=["SoftmaxFusionPass"],
        disable=["ConvBatchnormFusionPass"],
    )
    assert state(plan, "SoftmaxFusionPass") == (True, Source.CLI)
    assert state(plan, "ConvBatchnormFusionPass") == (False, Source.CLI)
    plan = plan_for(registry, switch_file=file, enable=["MatMulBiasAddFusionPass"])
    assert state(plan, "MatMulBiasAddFusionPass") == (True, Source.CLI)  # CLI beats ALL


def test_optimization_switch_beats_enable_and_disable(registry: PassRegistry) -> None:
    plan = plan_for(
        registry,
        disable=["SoftmaxFusionPass"],
        enable=["ConvBatchnormFusionPass"],
        optimization_switch={"SoftmaxFusionPass": True, "ConvBatchnormFusionPass": False},
    )
    assert state(plan, "SoftmaxFusionPass") == (True, Source.CLI)
    assert state(plan, "ConvBatchnormFusionPass") == (False, Source.CLI)
    decision = next(d for d in plan.decisions if d.name == "SoftmaxFusionPass")
    assert decision.detail == "--optimization_switch"


def test_enable_turns_on_a_default_off_pass(registry: PassRegistry) -> None:
    assert state(
        plan_for(registry, enable=["ExperimentalFusionPass"]), "ExperimentalFusionPass"
    ) == (True, Source.CLI)


def test_the_same_pass_enabled_and_disabled_is_an_error(registry: PassRegistry) -> None:
    with pytest.raises(FusectlError, match="both name SoftmaxFusionPass"):
        plan_for(registry, enable=["SoftmaxFusionPass"], disable=["SoftmaxFusionPass"])


def test_aliases_work_in_files_and_on_the_command_line(
    registry: PassRegistry, tmp_path: Path
) -> None:
    plan = plan_for(
        registry,
        switch_file=parse_switch_file(write(tmp_path, "conv_bias_add:off\n")),
        disable=["add_layer_norm_fusion"],
        optimization_switch={"matmul_elem_biasadd_fusion": False},
    )
    assert state(plan, "AABiasaddConvFusion") == (False, Source.FILE)
    assert state(plan, "AddLayerNormFusionPass") == (False, Source.CLI)
    assert state(plan, "MatMulBiasAddFusionPass") == (False, Source.CLI)
    assert plan.warnings == []


def test_legacy_file_reaches_both_categories(registry: PassRegistry, tmp_path: Path) -> None:
    plan = plan_for(
        registry,
        switch_file=parse_switch_file(write(tmp_path, "ALL:off\nConvActivationFusionPass:on\n")),
    )
    assert state(plan, "ConvActivationFusionPass") == (True, Source.FILE)
    assert state(plan, "AddLayerNormFusionPass") == (False, Source.ALL)
    assert state(plan, "SoftmaxFusionPass") == (False, Source.ALL)


def test_unknown_names_warn_with_a_suggestion_and_strict_makes_them_errors(
    registry: PassRegistry, tmp_path: Path
) -> None:
    file = json_file(tmp_path, {"Switch": {"GraphFusion": {"ConvBatchNormFusionPass": "off"}}})
    plan = plan_for(registry, switch_file=file, disable=["SoftmaxFusion"])
    assert any(
        "unknown pass name 'SoftmaxFusion' in --disable_pass; did you mean "
        "'SoftmaxFusionPass'?" in w
        for w in plan.warnings
    )
    assert any(
        "unknown pass name 'ConvBatchNormFusionPass'" in w
        and "did you mean 'ConvBatchnormFusionPass'?" in w
        for w in plan.warnings
    )
    assert state(plan, "ConvBatchnormFusionPass") == (True, Source.DEFAULT)
    with pytest.raises(FusectlError, match=r"unknown pass name 'SoftmaxFusion'.*--strict"):
        plan_for(registry, disable=["SoftmaxFusion"], strict=True)


def test_entry_under_the_wrong_category_warns(registry: PassRegistry, tmp_path: Path) -> None:
    plan = plan_for(
        registry,
        switch_file=json_file(
            tmp_path, {"Switch": {"GraphFusion": {"ConvActivationFusionPass": "off"}}}
        ),
    )
    assert state(plan, "ConvActivationFusionPass") == (True, Source.DEFAULT)
    assert any(
        "ConvActivationFusionPass is a UBFusion pass; its entry under GraphFusion has no "
        "effect" in w
        for w in plan.warnings
    )


def test_target_onnx_turns_ub_passes_off_and_says_why(registry: PassRegistry) -> None:
    plan = plan_for(registry, target="onnx", enable=["AddLayerNormFusionPass"])
    assert state(plan, "ConvActivationFusionPass") == (False, Source.TARGET)
    decision = next(d for d in plan.decisions if d.name == "AddLayerNormFusionPass")
    assert (decision.enabled, decision.source) == (False, Source.TARGET)
    assert "SkipLayerNormalization" in decision.detail
    assert plan.warnings == [
        "pass AddLayerNormFusionPass stays off: its output does not run with --target onnx"
    ]
    assert state(plan, "SoftmaxFusionPass") == (True, Source.DEFAULT)


def test_oo_level_o1_closes_all_but_the_exceptional_passes(
    registry: PassRegistry, tmp_path: Path
) -> None:
    file = json_file(
        tmp_path,
        {
            "ExceptionalPassOfO1Level": ["SoftmaxFusionPass"],
            "Switch": {"GraphFusion": {"ConvBatchnormFusionPass": "on"}},
        },
    )
    plan = plan_for(registry, switch_file=file, oo_level="O1", enable=["AABiasaddConvFusion"])
    assert state(plan, "SoftmaxFusionPass") == (True, Source.OO_LEVEL)
    assert state(plan, "ConvBatchnormFusionPass") == (False, Source.OO_LEVEL)
    assert state(plan, "ConvActivationFusionPass") == (False, Source.OO_LEVEL)
    assert state(plan, "AABiasaddConvFusion") == (True, Source.CLI)
    assert state(plan, "DeadNodeEliminationPass") == (True, Source.FORCED)


def test_order_is_graph_then_ub_by_priority_then_required(registry: PassRegistry) -> None:
    names = [d.name for d in plan_for(registry).decisions]
    assert names == [
        "AABiasaddConvFusion",  # 4010
        "ConvBatchnormFusionPass",  # 4060
        "SoftmaxFusionPass",  # default band 8000
        "ExperimentalFusionPass",
        "MatMulBiasAddFusionPass",  # Down band 5120 runs after the default band
        "ConvActivationFusionPass",
        "AddLayerNormFusionPass",
        "DeadNodeEliminationPass",
    ]


def test_priority_section_reorders_within_a_category(
    registry: PassRegistry, tmp_path: Path
) -> None:
    file = json_file(
        tmp_path,
        {
            "Priority": {
                "GraphFusion": {
                    "Top": {"MatMulBiasAddFusionPass": "5"},
                    "Down": {"AABiasaddConvFusion": "2500"},
                },
                "UBFusion": {"Main": {"AddLayerNormFusionPass": "1000"}},
            }
        },
    )
    names = [d.name for d in plan_for(registry, switch_file=file).decisions]
    assert names == [
        "MatMulBiasAddFusionPass",
        "ConvBatchnormFusionPass",
        "SoftmaxFusionPass",
        "ExperimentalFusionPass",
        "AABiasaddConvFusion",
        "AddLayerNormFusionPass",
        "ConvActivationFusionPass",
        "DeadNodeEliminationPass",
    ]


def test_switch_template_resolves_cleanly_against_the_real_catalogue(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    result = run_cli("switch-template")
    assert result.exit_code == 0
    template = parse_switch_file(write(tmp_path, result.stdout, "template.json"))
    real = load_builtin_passes()
    plan = resolve(real, SwitchRequest(switch_file=template))
    assert plan.warnings == []
    named = set(template.entries[G]) | set(template.entries[U])
    assert named == {p.spec.name for p in real}
    off = run_cli("switch-template", "--all", "off")
    document = json.loads(off.stdout)
    assert set(document["Switch"]["GraphFusion"].values()) == {"off"}
