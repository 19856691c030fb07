"""specserve: a speculative-decoding (EAGLE-3) LLM server and toolkit."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import specserve` stays cheap for the CLI and the supervisor.
    if name in ("LLM", "SamplingParams"):
        from specserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
