"""Prompt forms (``ferrokv.inputs``): each accepted form gives the same ids, and each bad one a
``ValueError`` naming the field and value."""

from __future__ import annotations

import numpy as np
import pytest

from ferrokv.inputs import prompt_ids, validate_prompt_ids


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text]


def test_every_prompt_form_gives_its_ids():
    tok = _Tok()
    assert prompt_ids(tok, "abc") == ("abc", [47, 48, 49])
    assert prompt_ids(tok, {"prompt": "abc"}) == ("abc", [47, 48, 49])
    assert prompt_ids(tok, {"prompt_token_ids": [1, 2]}) == (None, [1, 2])
    assert prompt_ids(tok, {"prompt_token_ids": np.array([3, 4]), "prompt": "x"}) == ("x", [3, 4])


@pytest.mark.parametrize("prompt, field", [
    (12, "prompt"), ({"text": "x"}, "prompt"), ({"prompt_token_ids": "12"}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, True]}, "prompt_token_ids[1]"), ({"prompt_token_ids": [1.5]}, "prompt_token_ids[0]"),
    ("bad \udcff surrogate", "prompt"),
])
def test_bad_prompts_name_the_field(prompt, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        prompt_ids(_Tok(), prompt)


@pytest.mark.parametrize("ids, match", [([], "empty"), ([1, 60], r"prompt_token_ids\[1\]=60"), ([1] * 9, "max_model_len=8")])
def test_ids_are_checked_against_the_vocabulary_and_length(ids, match):
    with pytest.raises(ValueError, match=match):
        validate_prompt_ids(ids, 50, 8)
    validate_prompt_ids([0, 49], 50, 8)
