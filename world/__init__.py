"""The synthetic world: videos whose every event is known, a tiny target trained on them from
nothing, and the product's demos on that pair. Draft training is sparrow.training.

    scenes.py          what happens in a synthetic video, said in words (WorldVideo, the tokenizer)
    target_model.py    the world target (a tiny Qwen2.5-VL) and its accuracy
    target_data.py     what a target training step reads, and its loss
    target_train.py    `sparrow world train-target`: the stages, checkpoints and report
    draft_data.py      world data for the draft, and held-out tau
    compare_drafts.py  `sparrow world compare-drafts`: several drafts on the same fresh videos
    demo.py            `sparrow world demo`: a fresh video, a streamed answer, the speedup
    long_demo.py       `sparrow demo --long`: a ~25k-visual-token video end to end
    live_stream.py     a continuous synthetic live stream with ground truth at every moment
    live_words.py      the live world in words: questions and answers about "now"
    live_target.py     `sparrow world train-live-target`: a target that keeps real time"""
