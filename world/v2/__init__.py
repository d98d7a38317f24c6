"""World v2: several objects, real events, answers of real length (issue 47). v1 (sparrow.world)
stays for the fast tests; v2 is the benchmark world. See docs/world-v2.md.

    scenes_v2.py     what happens: a scene as a pure function of its seed and length (ground truth)
    render_v2.py     any frame on its own; the video encoded to mp4 (v1's drawing and encoder)
    narration.py     the dense narration with times, and its parser (event recall)
    questions_v2.py  counting, ordering, "when", yes/no and per-object questions, several wordings
    vocab_v2.py      the word-level vocabulary and tokenizer (v1's tokenizer helper)
    splits_v2.py     seed ranges of train / test / benchmark, never overlapping
    dataset_v2.py    `sparrow world make-data-v2`: videos + a JSONL manifest + the scenes' truth
    target_v2.py     the v2 target's config, pool and training data (v1's recipe, parametrised)
    eval_v2.py       held-out scores per question kind and per length, narration event recall
    commands_v2.py   `sparrow world train-target-v2` (resumable stages) and `sparrow world eval-v2`"""
