// decode<D, k_bits, v_bits, exact, group_a, k_bits_b> for each build of TURBOATTN_KEY_GROUPS (keys in two channel
// groups), with and without exact rows: one translation unit, built in parallel with the others.
#include "decode.cuh"

int launch_decode_groups(const turboattn::DecodeParams& params, int head_dim, int group_a, int k_bits, int k_bits_b,
                         int v_bits, bool exact, int batch_kv_heads, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
#define TURBOATTN_LAUNCH_GROUPS(D, GA, KB, KB2, VB)                                                         \
  if (head_dim == D && group_a == GA && k_bits == KB && k_bits_b == KB2 && v_bits == VB)                    \
    return exact ? turboattn::launch<D, KB, VB, true, GA, KB2>(params, batch_kv_heads, s)                   \
                 : turboattn::launch<D, KB, VB, false, GA, KB2>(params, batch_kv_heads, s);
  TURBOATTN_KEY_GROUPS(TURBOATTN_LAUNCH_GROUPS)
#undef TURBOATTN_LAUNCH_GROUPS
  return -1;
}

int ctas_per_sm_groups(int head_dim, int group_a, int k_bits, int k_bits_b, int v_bits, bool exact) {
#define TURBOATTN_CTAS_GROUPS(D, GA, KB, KB2, VB)                                                           \
  if (head_dim == D && group_a == GA && k_bits == KB && k_bits_b == KB2 && v_bits == VB)                    \
    return exact ? turboattn::ctas_per_sm<D, KB, VB, true, GA, KB2>()                                       \
                 : turboattn::ctas_per_sm<D, KB, VB, false, GA, KB2>();
  TURBOATTN_KEY_GROUPS(TURBOATTN_CTAS_GROUPS)
#undef TURBOATTN_CTAS_GROUPS
  return -1;
}
