"""The toy GENERATE reads its prompt chunk by chunk, keeping a digest and a bounded tail (issue 22,
item 3: a shared 4 MiB chunk repeated 128 times once held 2.5 GiB): its answer is the one
``toy_answer`` gives for the whole prompt, however the prompt is cut."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.actions import TOPIC_CHARS, _toy_answer, last_words, toy_answer

pieces = st.lists(st.text(alphabet=st.sampled_from("ab é\n\t"), max_size=2 * TOPIC_CHARS), max_size=6)


@given(pieces)
def test_a_prompt_read_in_pieces_gets_the_answer_of_the_whole(parts: list[str]) -> None:
    digest, tail = hashlib.sha256(), ""
    for text in parts:
        digest.update(text.encode())
        tail = last_words(tail + text)
        assert len(tail) <= 9 * (TOPIC_CHARS + 1)
    assert _toy_answer(tail, digest.hexdigest()) == toy_answer("".join(parts))
