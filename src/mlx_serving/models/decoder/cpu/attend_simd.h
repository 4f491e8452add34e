// The attention kernel over one vector width (no include guard: attend.cpp includes it once per
// instruction set, inside that set's namespace). Before inclusion: ATT_TARGET (the functions' target
// attribute, or empty) and struct S: V (a vector of W float32 lanes), zero / set1 / load / store /
// add / sub / fma / max, sum / hmax (the lanes reduced in one fixed order), exp (0 below -87.3, so
// padding lanes of -inf add nothing) and widen<K>(Ref, c, shift): lanes [c * W, c * W + W) of a
// stored head vector in float32.

// mx.hadamard_transform of x (n, a power of 2) in place: kv_store.cpp's hadamard (the same butterflies,
// each output the same sums, then the same scale), its stages' inner loops contiguous, in vectors.
ATT_TARGET void rotate(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h <<= 1)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float scale = 1.0f / std::sqrt(static_cast<int>(n));
  for (int64_t j = 0; j < n; ++j) x[j] *= scale;
}

// Scores of M heads (qs: M * d, scaled) against keys [0, n): sc[j * ns + p] = q_j . k_p, each key
// widened once for the M heads; each dot summed lane-wise over d then reduced (S::sum).
template <KvKind K, int M>
ATT_TARGET void scores(const Keys& keys, int64_t n, const float* qs, float* sc, int64_t ns) {
  const int64_t nv = keys.d / S::W;
  for (int64_t p = 0; p < n; ++p) {
    const Ref r = keys.at(p);
    typename S::V acc[M];
    for (int j = 0; j < M; ++j) acc[j] = S::zero();
    for (int64_t c = 0; c < nv; ++c) {
      const typename S::V k = S::template widen<K>(r, c, keys.shift);
      for (int j = 0; j < M; ++j) acc[j] = S::fma(S::load(qs + j * keys.d + c * S::W), k, acc[j]);
    }
    for (int j = 0; j < M; ++j) sc[j * ns + p] = S::sum(acc[j]);
  }
}

// s[0, ns) (ns a multiple of W, s[n, ns) = -inf) -> exp(s - max); returns the sum (lane-wise, then S::sum).
ATT_TARGET float softmax_weights(float* s, int64_t ns) {
  typename S::V top = S::load(s);
  for (int64_t i = S::W; i < ns; i += S::W) top = S::max(top, S::load(s + i));
  const typename S::V t = S::set1(S::hmax(top));
  typename S::V sum = S::zero();
  for (int64_t i = 0; i < ns; i += S::W) {
    const typename S::V e = S::exp(S::sub(S::load(s + i), t));
    S::store(s + i, e);
    sum = S::add(sum, e);
  }
  return S::sum(sum);
}

// o[j * d + lanes of vectors c0 .. c0 + C) = sum_p w[j * ns + p] * v_p over the same lanes, the M
// heads' C vectors of sums held in registers while the keys pass (one load of each value vector).
template <KvKind K, int M, int C>
ATT_TARGET void values_part(const Keys& vals, int64_t n, const float* w, int64_t ns, int64_t c0, float* o) {
  typename S::V acc[M][C];
  for (int j = 0; j < M; ++j)
    for (int u = 0; u < C; ++u) acc[j][u] = S::zero();
  for (int64_t p = 0; p < n; ++p) {
    const Ref r = vals.at(p);
    typename S::V wp[M];
    for (int j = 0; j < M; ++j) wp[j] = S::set1(w[j * ns + p]);
    for (int u = 0; u < C; ++u) {
      const typename S::V v = S::template widen<K>(r, c0 + u, vals.shift);
      for (int j = 0; j < M; ++j) acc[j][u] = S::fma(wp[j], v, acc[j][u]);
    }
  }
  for (int j = 0; j < M; ++j)
    for (int u = 0; u < C; ++u) S::store(o + j * vals.d + (c0 + u) * S::W, acc[j][u]);
}

// M heads' unnormalized outputs o (M * d) and their weights' sums, head j over keys [0, lens[j]) (n =
// the most; scores in sc, M * ns): its scores over all n keys, those past its own replaced by -inf, its
// softmax over its own keys' vectors of lanes, weights past them 0, then the values of all n keys (each
// value vector loaded once for the M heads). A head's sums are those of the head alone over its keys
// (its weights past them add exact zeros).
template <KvKind K, int M>
ATT_TARGET void heads(const Keys& keys, const Keys& vals, const int64_t* lens, int64_t n, const float* qs, float* sc,
                      int64_t ns, float* sums, float* o) {
  scores<K, M>(keys, n, qs, sc, ns);
  for (int j = 0; j < M; ++j) {
    float* s = sc + j * ns;
    const int64_t own = (lens[j] + S::W - 1) / S::W * S::W;
    std::fill(s + lens[j], s + own, -INFINITY);  // padding lanes: weight 0
    sums[j] = softmax_weights(s, own);
    std::fill(s + own, s + ns, 0.f);
  }
  const int64_t nv = keys.d / S::W;
  constexpr int kC = S::W == 1 ? 8 : 4;  // vectors per pass: M * kC sums in registers
  int64_t c = 0;
  for (; c + kC <= nv; c += kC) values_part<K, M, kC>(vals, n, sc, ns, c, o);
  for (; c < nv; ++c) values_part<K, M, 1>(vals, n, sc, ns, c, o);
}

// The m heads' unnormalized outputs o (m * d) and their weights' sums (m), up to 4 heads alongside.
template <KvKind K>
ATT_TARGET void run_kind(const Keys& keys, const Keys& vals, const int64_t* lens, int64_t n, const float* qs,
                         int64_t m, float* sc, int64_t ns, float* sums, float* o) {
  const int64_t d = keys.d;
  for (int64_t j = 0; j < m; j += 4) {
    const float* q = qs + j * d;
    float* s = sc + j * ns;
    switch (std::min<int64_t>(4, m - j)) {
      case 1: heads<K, 1>(keys, vals, lens + j, n, q, s, ns, sums + j, o + j * d); break;
      case 2: heads<K, 2>(keys, vals, lens + j, n, q, s, ns, sums + j, o + j * d); break;
      case 3: heads<K, 3>(keys, vals, lens + j, n, q, s, ns, sums + j, o + j * d); break;
      default: heads<K, 4>(keys, vals, lens + j, n, q, s, ns, sums + j, o + j * d);
    }
  }
}

// run_kind of the cache's layout.
void run(KvKind kind, const Keys& keys, const Keys& vals, const int64_t* lens, int64_t n, const float* qs, int64_t m,
         float* sc, int64_t ns, float* sums, float* o) {
  switch (kind) {
    case KvKind::kF32: run_kind<KvKind::kF32>(keys, vals, lens, n, qs, m, sc, ns, sums, o); break;
    case KvKind::kF16: run_kind<KvKind::kF16>(keys, vals, lens, n, qs, m, sc, ns, sums, o); break;
    case KvKind::kBF16: run_kind<KvKind::kBF16>(keys, vals, lens, n, qs, m, sc, ns, sums, o); break;
    case KvKind::kQ8: run_kind<KvKind::kQ8>(keys, vals, lens, n, qs, m, sc, ns, sums, o); break;
    case KvKind::kQ4: run_kind<KvKind::kQ4>(keys, vals, lens, n, qs, m, sc, ns, sums, o); break;
  }
}
