// A decode step's decoder stack in one call: every Llama-family layer, for a step whose tokens are all decode rows
// (plain decodes and verifications), then the final norm.
//
// A small model's decode step on CPU is mostly the host cost of its ops, not their arithmetic: the trained draft's
// two layers (hidden 128) took about 1 ms a token, where their multiply-adds take tens of microseconds. Most of that
// is Python (module calls, dispatch checks, torch.ops' boxed calls); this op runs the same layer in C++ and calls the
// same kernels through the dispatcher (cpu_fused's norm / rotary / SwiGLU, cpu_attention's decode attention, the
// linears' tiles, oneDNN packed weight or F.linear by the same row crossover). Every row's bits are therefore the
// unfused path's: speculation's exactness and batch invariance do not depend on which path ran.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)> rms_norm_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kvfleet_cpu_fused::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)>();
  return op;
}

c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                            double, bool)>
add_rms_norm_op() {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvfleet_cpu_fused::add_rms_norm", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                    bool)>();
  return op;
}

c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)> rotary_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kvfleet_cpu_fused::rotary", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  return op;
}

c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, bool)> silu_and_mul_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kvfleet_cpu_fused::silu_and_mul", "")
                       .typed<at::Tensor(const at::Tensor&, bool)>();
  return op;
}

using AttentionSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, const OptTensor&, const OptTensor&, int64_t, bool);
c10::TypedOperatorHandle<AttentionSig> attention_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kvfleet_cpu_attention::decode_attention", "")
                       .typed<AttentionSig>();
  return op;
}

c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)> tiles_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kvfleet_cpu_f32::f32_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>();
  return op;
}

// mkldnn::_linear_pointwise, boxed: its Scalar?[] and str? arguments are simplest as IValues.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One linear as layers/linear.py's _Linear.matmul runs it (dense weights only: a quantized layer never comes here).
struct Linear {
  at::Tensor weight;  // [n, K]; on the meta device when only the packed copies hold it
  OptTensor packed, tiles, bias;
  int64_t few_below;  // rows below which the few-row path runs (tiles, else F.linear)

  at::Tensor operator()(const at::Tensor& x) const {
    if (x.size(0) < few_below) {
      if (!tiles) return at::linear(x, weight, bias);
      at::Tensor y = tiles_op().call(x, *tiles, weight.size(0), false);
      return bias ? y.add_(*bias) : y;
    }
    if (packed) return packed_linear(x, *packed, bias);
    return at::linear(x, weight, bias);
  }
};

constexpr int64_t TENSORS_PER_LAYER = 20;  // 4 norms' weights, then 4 linears of 4 (weight, packed, tiles, bias)

struct Layer {
  at::Tensor in_norm, post_norm;
  OptTensor q_norm, k_norm;  // Qwen3's per-head norms
  Linear qkv, o, gate_up, down;
};

Linear linear_at(const c10::List<OptTensor>& t, int64_t i, int64_t few_below) {
  TORCH_CHECK(t.get(i).has_value(), "kvfleet_cpu_decode: a linear's weight is missing (tensor ", i, ")");
  return Linear{*t.get(i), t.get(i + 1), t.get(i + 2), t.get(i + 3), few_below};
}

std::vector<Layer> layers_of(const c10::List<OptTensor>& t, at::IntArrayRef few_below) {
  TORCH_CHECK(t.size() % TENSORS_PER_LAYER == 0 && few_below.size() * TENSORS_PER_LAYER == 4 * t.size(),
              "kvfleet_cpu_decode: ", TENSORS_PER_LAYER, " tensors and 4 crossovers per layer");
  std::vector<Layer> layers;
  for (int64_t l = 0, n = static_cast<int64_t>(t.size()) / TENSORS_PER_LAYER; l < n; ++l) {
    const int64_t b = l * TENSORS_PER_LAYER;
    TORCH_CHECK(t.get(b).has_value() && t.get(b + 1).has_value(), "kvfleet_cpu_decode: layer ", l, "'s norms");
    layers.push_back(Layer{*t.get(b), *t.get(b + 1), t.get(b + 2), t.get(b + 3),
                           linear_at(t, b + 4, few_below[4 * l]), linear_at(t, b + 8, few_below[4 * l + 1]),
                           linear_at(t, b + 12, few_below[4 * l + 2]), linear_at(t, b + 16, few_below[4 * l + 3])});
  }
  return layers;
}

// k, v [T, KVH, D] (each token's heads contiguous) into their slots of [N, bs, KVH, D] caches; a negative slot
// stores nothing (reference.write_kv's contract).
void write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const int64_t* slots) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), slots_total = k_cache.size(0) * k_cache.size(1);
  const size_t bytes = static_cast<size_t>(row) * k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    TORCH_CHECK(s < slots_total, "kvfleet_cpu_decode: slot ", s, " is outside the cache (", slots_total, " slots)");
    std::memcpy(kc + s * static_cast<int64_t>(bytes), kp + t * ks, bytes);
    std::memcpy(vc + s * static_cast<int64_t>(bytes), vp + t * vs, bytes);
  }
}

// Where a group of decode rows [start, end) attends: its block tables and each row's context (seq_lens int64 [B], or
// decode_plan's prefix mask bool [B, L]).
struct Group {
  int64_t start, end;
  at::Tensor tables, lengths;
};

// The decoder stack: its layers, their caches and the final norm.
struct Stack {
  std::vector<Layer> layers;
  at::TensorList k_caches, v_caches;
  at::Tensor final_norm;
  int64_t H, KVH, D;
  double eps, scale;

  void check(const at::Tensor& x) const {
    const int64_t L = static_cast<int64_t>(layers.size());
    TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "kvfleet_cpu_decode: x must be [T, hidden] on CPU");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L,
                "kvfleet_cpu_decode: one K and one V cache per layer");
    for (int64_t l = 0; l < L; ++l)
      TORCH_CHECK(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() && k_caches[l].dim() == 4 &&
                  k_caches[l].size(2) == KVH && k_caches[l].size(3) == D &&
                  k_caches[l].scalar_type() == x.scalar_type() && v_caches[l].sizes() == k_caches[l].sizes() &&
                  v_caches[l].scalar_type() == x.scalar_type(),
                  "kvfleet_cpu_decode: layer ", l, "'s caches must be contiguous [N, bs, ", KVH, ", ", D, "] ",
                  x.scalar_type());
  }

  // x [T, hidden] embedded decode rows, cos / sin [T, D] their rotary rows, slots [T] → the final norm's output.
  at::Tensor run(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const int64_t* slots,
                 const std::vector<Group>& groups) const {
    const int64_t T = x_in.size(0), q_size = H * D, kv_size = KVH * D;
    const bool one_group = groups.size() == 1 && groups[0].start == 0 && groups[0].end == T;
    at::Tensor x = x_in, residual;
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& layer = layers[l];
      if (l == 0) {
        residual = x;
        x = rms_norm_op().call(x, layer.in_norm, eps, false);
      } else {
        std::tie(x, residual) = add_rms_norm_op().call(x, residual, layer.in_norm, eps, false);
      }
      // Attention: packed QKV, Qwen3's head norms, rotary over q and k together, the K/V write, decode attention.
      const at::Tensor qkv = layer.qkv(x);
      at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({T, H + KVH, D});
      if (layer.q_norm && layer.k_norm) {
        const at::Tensor q = rms_norm_op().call(qk.narrow(1, 0, H).reshape({T * H, D}), *layer.q_norm, eps, false);
        const at::Tensor k =
            rms_norm_op().call(qk.narrow(1, H, KVH).reshape({T * KVH, D}), *layer.k_norm, eps, false);
        qk = at::cat({q.view({T, H, D}), k.view({T, KVH, D})}, 1);
      }
      qk = rotary_op().call(qk, cos, sin, false);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, KVH, D});
      write_kv(k_caches[l], v_caches[l], qk.narrow(1, H, KVH), v, slots);
      const at::Tensor q_all = qk.narrow(1, 0, H);
      at::Tensor attn = one_group ? at::Tensor() : at::empty({T, H, D}, x.options());
      for (const Group& g : groups) {
        const at::Tensor q = q_all.narrow(0, g.start, g.end - g.start);
        const bool f32 = q.scalar_type() == at::kFloat;
        at::Tensor out = attention_op().call(f32 ? q : q.to(at::kFloat), k_caches[l], v_caches[l],
                                             g.tables.view({q.size(0), -1}), g.lengths, scale, std::nullopt,
                                             std::nullopt, 0, false);
        if (!f32) out = out.to(q.scalar_type());
        if (one_group)
          attn = out;
        else
          attn.narrow(0, g.start, g.end - g.start).copy_(out);
      }
      x = layer.o(attn.view({T, q_size}));
      std::tie(x, residual) = add_rms_norm_op().call(x, residual, layer.post_norm, eps, false);
      x = layer.down(silu_and_mul_op().call(layer.gate_up(x), false));
    }
    return std::get<0>(add_rms_norm_op().call(x, residual, final_norm, eps, false));
  }
};

Stack stack_of(const c10::List<OptTensor>& tensors, at::IntArrayRef few_below, at::TensorList k_caches,
               at::TensorList v_caches, const at::Tensor& final_norm, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale) {
  return Stack{layers_of(tensors, few_below), k_caches, v_caches, final_norm, num_heads, num_kv_heads, head_dim,
               eps, scale};
}

// x [T, hidden] (the embedded tokens), cos / sin [T, D] (each token's rows of the rotary tables); every token a
// decode row, attending through the decode groups [starts[g], ends[g]) with their block tables and lengths.
// Returns the final norm's output [T, hidden].
at::Tensor decode_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          const c10::List<OptTensor>& tensors, at::IntArrayRef few_below, at::TensorList k_caches,
                          at::TensorList v_caches, const at::Tensor& slot_mapping, at::IntArrayRef starts,
                          at::IntArrayRef ends, at::TensorList tables, at::TensorList lengths,
                          const at::Tensor& final_norm, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          double eps, double scale) {
  const Stack stack = stack_of(tensors, few_below, k_caches, v_caches, final_norm, num_heads, num_kv_heads,
                               head_dim, eps, scale);
  stack.check(x);
  const int64_t T = x.size(0);
  TORCH_CHECK(starts.size() == ends.size() && starts.size() == tables.size() && starts.size() == lengths.size(),
              "kvfleet_cpu_decode: each decode group needs a start, an end, a table and its lengths");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T, "slot_mapping: int64 [T]");
  std::vector<Group> groups;
  for (size_t g = 0; g < starts.size(); ++g) {
    TORCH_CHECK(0 <= starts[g] && starts[g] <= ends[g] && ends[g] <= T, "kvfleet_cpu_decode: group ", g,
                " is out of the batch");
    groups.push_back(Group{starts[g], ends[g], tables[g], lengths[g]});
  }
  const at::Tensor slots = slot_mapping.contiguous();
  return stack.run(x, cos, sin, slots.const_data_ptr<int64_t>(), groups);
}

// Each row's argmax as the sampler takes it: cpu_argmax's op where it is loaded (torch.argmax's answer, faster).
at::Tensor row_argmax(const at::Tensor& logits) {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"kvfleet_cpu_argmax::argmax", ""});
  const bool fits = (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                    logits.size(1) > 0 && logits.stride(1) == 1;
  if (op && fits) return op->typed<at::Tensor(const at::Tensor&, bool)>().call(logits, false);
  return logits.argmax(-1);
}

// One forward of a draft's rows: row t is a token of request req[t] at position pos[t] (it attends to the request's
// cache up to there); sample[b] is the row whose logits give request b's proposal. Runs the stack, the LM head over
// the sampled rows and the row argmax, as the Python path would. Returns the proposals [len(sample)] int64.
struct DraftForward {
  const Stack& stack;
  const Linear& lm_head;
  const at::Tensor &embed, &cos_table, &sin_table;
  const int64_t* tp;  // block tables [B, W]
  int64_t W, blocks, block_size;

  at::Tensor operator()(const at::Tensor& ids, const std::vector<int64_t>& req, const std::vector<int64_t>& pos,
                        const std::vector<int64_t>& sample) const {
    const int64_t T = static_cast<int64_t>(pos.size());
    const at::TensorOptions longs = ids.options();
    std::vector<int64_t> slots(T), lens(T);
    at::Tensor rt = at::empty({T, W}, longs);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = req[t], b = pos[t] / block_size;
      TORCH_CHECK(pos[t] >= 0 && b < W, "kvfleet_cpu_decode: row ", r, "'s position ", pos[t],
                  " is past its block table");
      const int64_t id = tp[r * W + b];
      TORCH_CHECK(id >= 0 && id < blocks, "kvfleet_cpu_decode: row ", r, ": block id ", id, " out of range");
      slots[t] = id * block_size + pos[t] % block_size;
      lens[t] = pos[t] + 1;
      std::memcpy(rt.mutable_data_ptr<int64_t>() + t * W, tp + r * W, static_cast<size_t>(W) * sizeof(int64_t));
    }
    const at::Tensor positions = at::tensor(pos, longs);
    const at::Tensor x = at::embedding(embed, ids);
    stack.check(x);
    at::Tensor h = stack.run(x, cos_table.index_select(0, positions), sin_table.index_select(0, positions),
                             slots.data(), {Group{0, T, rt, at::tensor(lens, longs)}});
    if (static_cast<int64_t>(sample.size()) != T) h = h.index_select(0, at::tensor(sample, longs));
    return row_argmax(lm_head(h));
  }
};

// A draft model's greedy proposals, its whole run in one call. First forward: request i's rows[i] tokens (`ids`, in
// request order: the positions its K/V lacks, then its newest token) at positions starts[i] onwards; its last row
// proposes token 0. Then each further forward feeds every request its last proposal at the next position, until it
// has counts[i] proposals, rows dropping out as their counts end, as the Python loop does. tables [B, W] int64 block
// tables; head_* the LM head as one Linear; cos_table / sin_table the rotary tables [max_positions, D]. Returns
// ([B, max(counts)] int64, -1 past a request's count; the seconds until the first proposals were known).
std::tuple<at::Tensor, double> propose_greedy(
    const at::Tensor& ids_in, at::IntArrayRef starts, at::IntArrayRef rows, at::IntArrayRef counts,
    const at::Tensor& tables_in, int64_t block_size, const at::Tensor& embed, const c10::List<OptTensor>& head,
    int64_t head_few_below, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const c10::List<OptTensor>& tensors, at::IntArrayRef few_below, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& final_norm, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
    double scale) {
  const auto started = std::chrono::steady_clock::now();
  const Stack stack = stack_of(tensors, few_below, k_caches, v_caches, final_norm, num_heads, num_kv_heads,
                               head_dim, eps, scale);
  const int64_t B = static_cast<int64_t>(starts.size());
  TORCH_CHECK(B > 0 && static_cast<int64_t>(rows.size()) == B && static_cast<int64_t>(counts.size()) == B,
              "kvfleet_cpu_decode: a start, a row count and a proposal count per request");
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "kvfleet_cpu_decode: ids must be int64 [T]");
  TORCH_CHECK(tables_in.dim() == 2 && tables_in.size(0) == B && tables_in.scalar_type() == at::kLong,
              "kvfleet_cpu_decode: tables must be int64 [B, W]");
  TORCH_CHECK(head.size() == 4, "kvfleet_cpu_decode: the head is (weight, packed, tiles, bias)");
  const Linear lm_head = linear_at(head, 0, head_few_below);
  const at::Tensor tables = tables_in.contiguous(), ids = ids_in.contiguous();
  const DraftForward forward{stack, lm_head, embed, cos_table, sin_table, tables.const_data_ptr<int64_t>(),
                             tables.size(1), k_caches.empty() ? 0 : k_caches[0].size(0), block_size};
  std::vector<int64_t> req, pos, sample, base(B);
  for (int64_t i = 0; i < B; ++i) {
    TORCH_CHECK(rows[i] >= 1 && counts[i] >= 1, "kvfleet_cpu_decode: request ", i, " needs a row and a proposal");
    for (int64_t r = 0; r < rows[i]; ++r) {
      req.push_back(i);
      pos.push_back(starts[i] + r);
    }
    sample.push_back(static_cast<int64_t>(pos.size()) - 1);
    base[i] = starts[i] + rows[i] - 1;
  }
  TORCH_CHECK(ids.numel() == static_cast<int64_t>(pos.size()), "kvfleet_cpu_decode: ", pos.size(),
              " rows but ", ids.numel(), " ids");
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  at::Tensor out = at::full({B, most}, -1, ids.options());
  at::Tensor tokens = forward(ids, req, pos, sample);
  out.select(1, 0).copy_(tokens);
  const double first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::vector<int64_t> active(B);
  for (int64_t i = 0; i < B; ++i) active[i] = i;
  for (int64_t j = 1; j < most; ++j) {
    std::vector<int64_t> keep, still;  // positions in `active` that go on, and their requests
    for (size_t a = 0; a < active.size(); ++a)
      if (counts[active[a]] > j) {
        keep.push_back(static_cast<int64_t>(a));
        still.push_back(active[a]);
      }
    if (still.size() != active.size()) {
      tokens = tokens.index_select(0, at::tensor(keep, ids.options()));
      active = still;
    }
    const int64_t n = static_cast<int64_t>(active.size());
    std::vector<int64_t> next(n), every(n);
    for (int64_t a = 0; a < n; ++a) {
      next[a] = base[active[a]] + j;
      every[a] = a;
    }
    tokens = forward(tokens, active, next, every);
    out.select(1, j).index_put_({at::tensor(active, ids.options())}, tokens);
  }
  return {out, first_s};
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_decode, m) {
  m.def("decode_forward(Tensor x, Tensor cos, Tensor sin, Tensor?[] tensors, int[] few_below, Tensor[] k_caches, "
        "Tensor[] v_caches, Tensor slot_mapping, int[] starts, int[] ends, Tensor[] tables, Tensor[] lengths, "
        "Tensor final_norm, int num_heads, int num_kv_heads, int head_dim, float eps, float scale) -> Tensor",
        &decode_forward);
  m.def("propose_greedy(Tensor ids, int[] starts, int[] rows, int[] counts, Tensor tables, int block_size, "
        "Tensor embed, Tensor?[] head, int head_few_below, Tensor cos_table, Tensor sin_table, Tensor?[] tensors, "
        "int[] few_below, Tensor[] k_caches, Tensor[] v_caches, Tensor final_norm, int num_heads, int num_kv_heads, "
        "int head_dim, float eps, float scale) -> (Tensor, float)",
        &propose_greedy);
}
