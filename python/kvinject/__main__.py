"""``python -m kvinject``: which libkvinject the package loaded, how it was
found, its version and build features."""
import kvinject as kvi

feats = [name for bit, name in ((kvi.FEATURE_CUDA, "cuda"), (kvi.FEATURE_CUBLASLT, "cublaslt"),
                                (kvi.FEATURE_NCCL, "nccl")) if kvi.features() & bit]
print("kvinject %s (package %s)" % (kvi.__version__, kvi.__file__))
print("libkvinject %s: %s (found by %s)" % (kvi.version(), kvi.library_path(), kvi.library_found_by()))
print("features: %s" % (" ".join(feats) or "none (CPU only)"))
