"""World v2's word-level vocabulary and tokenizer.

The tokenizer is v1's (`sparrow.world.scenes.world_tokenizer`: a real `transformers`
PreTrainedTokenizerFast over a WordLevel model, the Qwen2-VL special tokens and chat template)
with v2's words as its extra words, so it saves with save_pretrained and loads with
from_pretrained like any tokenizer. Numbers are words: counts, minutes 0-59 and two-digit
seconds 00-59 (a time "1 : 05" is three ids), so the vocabulary has no unknown ids for any
video up to an hour.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from sparrow.world.scenes import world_tokenizer
from sparrow.world.v2.narration import VERBS
from sparrow.world.v2.questions_v2 import ANSWER_FORMS, COLUMNS, QUESTIONS_V2, ROWS, YES_NO
from sparrow.world.v2.scenes_v2 import COLOURS, DIRECTIONS, SHAPES, SIDES, SIZES

# every word the narration and the answers use besides the scene's own names (narration.py,
# questions_v2.py); tests/test_world_v2.py checks many scenes' texts have no unknown id
NARRATION_WORDS = ("at : there is are object objects a , and ; now no the enters from leaves through is gone "
                   "moves toward stops bumps into turns video ends with it nothing else happens to yes . ?")


def v2_words() -> list[str]:
    """Every word of world v2: names, numbers, times, the narration's and the questions' words."""
    words = set(NARRATION_WORDS.split()) | set(COLOURS) | set(SHAPES) | set(SIZES) | set(SIDES)
    words |= {w for d in DIRECTIONS for w in d.split()} | {w for forms in VERBS.values() for w in forms}
    words |= {str(n) for n in range(60)} | {f"{n:02d}" for n in range(10)}
    words |= set(COLUMNS) | set(ROWS)
    for wording in (*(q for qs in QUESTIONS_V2.values() for q in qs), *(q for qs in YES_NO.values() for q in qs),
                    *ANSWER_FORMS.values()):
        words |= {w for w in wording.split() if "{" not in w}
    return sorted(words)


def v2_tokenizer() -> PreTrainedTokenizerFast:
    """v1's tokenizer with every v2 word (v1's words stay: one tokenizer reads both worlds)."""
    return world_tokenizer(extra_words=v2_words())
