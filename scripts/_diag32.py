from onnx_genrt.engine import Model, generate_batch
from onnx_genrt.generate_cli import default_model_dir
m = Model(default_model_dir(), provider="cuda")
for n in (32, 24, 17):
    r = generate_batch(m, ["def f(x):"] * n, 8)
    print(n, m.session.all_graph_stats()["primary"]["fallback_reasons"])
