"""Why a storage dtype fails on a model: its keys' outlier channels.

Runs one prompt of random token ids through a Hugging Face model, takes every
layer's keys and queries before rotary embedding (the k_proj and q_proj
outputs, bias included: what the store keeps), and prints per layer: the
largest key magnitude and its channel, that channel's spread over the
tokens, and how far the attention logits q.k move when the keys go through
fp8 e4m3 with one scale per (page, head), as the store's fp8 dtype keeps
them, against the same fp8 after each channel's mean over the prompt is
taken out first. A key channel that is large but nearly constant (a bias)
takes the whole fp8 range of its head, and e4m3's 3-bit mantissa then moves
logits by whole units.

With --stores (e.g. fp8,q4,bf16) the keys also go through the library itself:
each layer's keys and values are put as one fact of --tokens tokens into a
CPU store of that dtype (pages of --page tokens) and read back, and the table
gets each store's logit error (max / std) beside the simulations.

    python -m kvinject_bench.key_outliers --model DIR [--tokens 256] [--page 16] [--stores fp8,q4]
"""
import argparse


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--page", type=int, default=16, help="the store's page_tokens")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--stores", default="", help="store dtypes to round-trip the keys through (fp8, q4, bf16, fp16)")
    args = ap.parse_args(argv)
    if args.tokens % args.page:
        ap.error("--tokens must be a multiple of --page")
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    stores = [x.strip() for x in args.stores.split(",") if x.strip()]
    cfg = m.config
    H = cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    G = cfg.num_attention_heads // H
    ks, qs, vs = {}, {}, {}
    for i, layer in enumerate(m.model.layers):
        layer.self_attn.k_proj.register_forward_hook(lambda mod, a, o, i=i: ks.__setitem__(i, o[0].float()))
        layer.self_attn.q_proj.register_forward_hook(lambda mod, a, o, i=i: qs.__setitem__(i, o[0].float()))
        layer.self_attn.v_proj.register_forward_hook(lambda mod, a, o, i=i: vs.__setitem__(i, o[0].float()))
    ids = torch.randint(1000, 20000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(ids.to(args.device))

    def fp8(x):  # one scale per (page, head): amax / 448, as kvinject/store.h "fp8 storage"
        y = x.view(args.tokens // args.page, args.page, H, D)
        s = y.abs().amax(dim=(1, 3), keepdim=True).clamp_min(2.0 ** -126) / 448
        return ((y / s).to(torch.float8_e4m3fn).float() * s).view(args.tokens, H * D)

    L = len(m.model.layers)
    back = {name: round_trip(name, ks, vs, L, H, D, args) for name in stores}
    print("| layer | max abs key (channel) | that channel's std over tokens | median channel max | "
          "logit std | logit error, fp8 max / std | after the channel mean, max / std |"
          + "".join(" store %s, max / std |" % n for n in stores))
    print("| --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(stores))
    for i in range(len(m.model.layers)):
        k, q = ks[i], qs[i]
        qh = q.view(-1, H, G, D)
        ref = torch.einsum("thgd,shd->hgts", qh, k.view(-1, H, D))

        def err(kk):
            e = torch.einsum("thgd,shd->hgts", qh, kk.view(-1, H, D)) - ref
            return e.abs().max().item(), e.std().item()

        mu = k.mean(0, keepdim=True)
        a, b = err(fp8(k)), err(fp8(k - mu) + mu)
        top = k.abs().amax(0)
        ch = int(top.argmax())
        cells = "".join(" %.2f / %.3f |" % err(back[n][i]) for n in stores)
        print("| %d | %.1f (%d) | %.2f | %.2f | %.1f | %.2f / %.3f | %.2f / %.3f |%s"
              % (i, top.max().item(), ch, k[:, ch].std().item(), top.median().item(), ref.std().item(),
                 a[0], a[1], b[0], b[1], cells))


def round_trip(name, ks, vs, L, H, D, args):
    """Every layer's keys as the library's CPU store of dtype `name` keeps them:
    one fact of all the tokens, put from fp32 and read back as fp32."""
    import torch
    from kvinject import DType, Model, RopeStyle, Store
    dtype = {"fp8": DType.FP8_E4M3, "q4": DType.Q4, "bf16": DType.BF16, "fp16": DType.FP16}[name]
    model = Model(L, H, D)
    model.set_rope(style=RopeStyle.NONE)
    T = args.tokens
    k = torch.stack([ks[i].cpu().view(T, H, D) for i in range(L)]).contiguous()
    v = torch.stack([vs[i].cpu().view(T, H, D) for i in range(L)]).contiguous()
    with Store(model, 4 * k.numel() * 4 + (64 << 20), dtype=dtype, page_tokens=args.page) as st:
        st.put(1, 1, k, v)
        ko, vo = torch.empty_like(k), torch.empty_like(v)
        st.read(1, 1, ko, vo)
    return [ko[i].reshape(T, H * D).to(ks[0].device) for i in range(L)]


if __name__ == "__main__":
    main()
