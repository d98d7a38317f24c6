"""The `sparrow` command line (installed as the `sparrow` script; `python -m sparrow.cli`).

    main.py      the parser and the entry point; every command takes --verbose
    demo.py      `sparrow demo [--long]`: the committed world pair on a fresh video
    serve.py     `sparrow serve [--ray]`: gRPC and the OpenAI-compatible HTTP API, embedded or on Ray Serve
    generate.py  `sparrow generate`: stream an answer from a server
    live.py      `sparrow live`: play a file (or have the server read a URL) into a live session

The training and world commands (`sparrow train-draft`, `sparrow world ...`) are registered by
sparrow.training.commands."""
