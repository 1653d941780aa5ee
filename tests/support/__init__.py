"""Small models and generated data shared by the tests and the benchmarks (nothing is downloaded):
`architectures` (real-architecture stems and their exports), `token_models` (token bottoms over ids),
`exporter_graphs` (ONNX graphs in other exporters' styles), `shaped_data` (text lines and audio clips),
`ushaped` (U-shaped split models). The benchmarks import them from the repository root as
`tests.support.NAME` (run them with `python -m benchmarks.NAME`)."""
