"""The public surface is explicit and every exported name resolves."""

import subprocess
import sys

import drmas_graph


def test_every_exported_name_resolves():
    for name in drmas_graph.__all__:
        assert getattr(drmas_graph, name) is not None, name
    assert {"instrument", "InstrumentedGraph", "Policy", "TransformersPolicy", "Episode", "Turn", "TraceStore",
            "replay", "areplay", "rescore", "compute_advantages", "train_graph", "TrainConfig", "Env", "SGLangPolicy",
            "VLLMPolicy"} <= set(drmas_graph.__all__)


def test_errors_subclass_the_stdlib_types_they_replace():
    from drmas_graph import errors

    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.ConfigError, errors.DrmasError)
    assert issubclass(errors.UnknownAgentError, ValueError)
    assert issubclass(errors.StrictModeError, LookupError)
    assert issubclass(errors.PolicyError, RuntimeError) and issubclass(errors.RolloutError, RuntimeError)


def test_importing_the_package_does_not_load_torch():
    code = "import sys, drmas_graph; drmas_graph.TraceStore; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_docs_document_every_config_field():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen", root / "scripts" / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = (root / "docs" / "reference" / "config.md").read_text()
    assert gen.config_table() in page, "run: python scripts/gen_reference.py"


def test_docs_training_example_runs(tmp_path, monkeypatch):
    """The example of docs/guide/training.md ("Training your graph") runs as written (in a scratch folder)."""
    from pathlib import Path

    section = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "training.md").read_text()
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("\n```", start)]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "docs/guide/training.md", "exec"), namespace)  # noqa: S102 - our own documentation
    result = namespace["result"]
    assert [r["step"] for r in result.history] == [0, 1, 2]
    assert (tmp_path / "runs" / "readme-example" / "metrics.jsonl").exists()
