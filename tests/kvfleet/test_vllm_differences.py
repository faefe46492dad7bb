"""docs/vllm_differences.md is what `python -m kvfleet.vllm_differences` writes from the code
as it is now, and what it says holds: each flag it lists as rejected ends `kvfleet serve`
with exit code 2 naming it, each field it lists as dropped is logged as ignored, and each
reason kept in kvfleet/vllm_reasons.py still explains something."""
from __future__ import annotations

import logging

import pytest

from gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvfleet.cli import build_parser, main
from kvfleet.vllm_differences import (
    DOC,
    DROPPED,
    REFUSED,
    TAKEN,
    UNRECOGNIZED,
    field_differences,
    flag_differences,
    reference,
    render,
    serve_options,
    stale_reasons,
)

REGENERATE = "docs/vllm_differences.md is out of date: run `python -m kvfleet.vllm_differences` and commit it"


def test_the_page_is_what_the_code_says_now() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), REGENERATE


def test_every_reason_kept_still_explains_something() -> None:
    assert stale_reasons(reference(), serve_options()) == [], "remove these from kvfleet/vllm_reasons.py"


def test_the_flags_listed_are_rejected_or_ignored_as_the_page_says(capsys: pytest.CaptureFixture[str]) -> None:
    options = serve_options()
    differences = flag_differences(reference()["serve_flags"], options)
    assert {d.how for d in differences} == {REFUSED, UNRECOGNIZED, TAKEN}
    parser = build_parser()
    for difference in differences:
        # A flag taken with a value (--show-hidden-metrics-for-version 0.7) is given one.
        value = ["0.7"] if difference.how == TAKEN and options[difference.name].nargs != 0 else []
        _, unknown = parser.parse_known_args(["serve", difference.name, *value])
        # A rejected flag is left unparsed (not taken as an abbreviation of one of kvfleet's).
        assert unknown == ([] if difference.how == TAKEN else [difference.name]), difference
    # What the command says of them, once per kind (main builds its parser anew each time: 20 ms).
    for difference in [d for d in differences if d.how == REFUSED] + [next(d for d in differences
                                                                           if d.how == UNRECOGNIZED)]:
        with pytest.raises(SystemExit) as exited:
            main(["serve", difference.name])
        assert exited.value.code == 2
        [line] = capsys.readouterr().err.splitlines()
        expected = (f"{difference.name}: {difference.why}" if difference.how == REFUSED
                    else f"unrecognized arguments: {difference.name}")
        assert line.startswith("kvfleet serve: error: ") and expected in line, (line, difference)


def test_the_fields_listed_as_dropped_are_logged_as_ignored(caplog: pytest.LogCaptureFixture) -> None:
    differences = field_differences(reference()["request_fields"])
    dropped = [d for d in differences if d.how == DROPPED]
    assert dropped and all(d.how in (DROPPED, TAKEN) for d in differences)
    bodies = {"completions": (CompletionRequest, {"prompt": "x"}),
              "chat": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})}
    for difference in dropped:
        for endpoint in difference.where.split(", "):
            model, body = bodies[endpoint]
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="gateway.request_body"):
                model.model_validate({**body, difference.name: 1})
            assert f"'{difference.name}'" in caplog.text, (endpoint, difference)
