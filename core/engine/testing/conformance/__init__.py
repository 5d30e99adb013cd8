"""The conformance kit: pytest checks of the plugin contract, pointed at your implementations.

    python -m pytest --pyargs engine.testing.conformance --engine-attention mykernel
    python -m pytest --pyargs engine.testing.conformance --engine-sampler mine \\
        --engine-logits-processor force_token --engine-logits-processor-params '{"extra_args": {"force_token": 5}}'

Each option may be given several times; a kind that is not named is not checked. The options come from
``engine.testing.conformance.plugin`` (a pytest plugin registered by the ``engine`` distribution).
"""
