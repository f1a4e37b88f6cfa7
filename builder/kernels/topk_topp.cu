// Top-k / top-p sampling, exact for given uniforms: cudaenv's own kernel for the
// kernel-compile, cubin and sampling checks (builder/verify/).
//
// Per row: sort tokens by probability descending, ties by index ascending (CUB's segmented
// radix sort is stable, and values start as 0..V-1); keep the first min(top_k, V) tokens
// (top_k <= 0 keeps all) while the mass before a token is below top_p * row total; then
// inverse-CDF over the kept set: the first kept token whose inclusive cumulative mass
// exceeds u * kept mass. Sums are float64 and sequential in that order, exactly as the
// Python reference (builder/verify/reference.py), so results agree bit for bit; build with
// --fmad=false so no multiply-add is fused differently from the reference.
//
// Harness: topk_topp INPUT OUTPUT. INPUT: "rows vocab draws", then per row "top_k top_p",
// the vocab probabilities, the draws uniforms. OUTPUT: per row, the draws sampled tokens.
// Exit codes: 0 ok, 2 bad input, 3 no usable GPU (the message says why), 4 CUDA error.
#include <cub/device/device_segmented_radix_sort.cuh>

#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                  \
  do {                                                                               \
    cudaError_t err_ = (call);                                                       \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s (%s:%d)\n", cudaGetErrorName(err_),               \
                   cudaGetErrorString(err_), __FILE__, __LINE__);                    \
      std::exit(4);                                                                  \
    }                                                                                \
  } while (0)

__global__ void iota_rows(int* idx, int* offsets, int rows, int vocab) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < rows * vocab) idx[t] = t % vocab;
  if (t <= rows) offsets[t] = t * vocab;
}

__global__ void sample_rows(const double* probs, const double* sorted_p, const int* sorted_idx,
                            const int* top_k, const double* top_p, const double* us, int vocab,
                            int draws, int* out) {
  const int r = blockIdx.x;
  const double* row = probs + static_cast<size_t>(r) * vocab;
  const double* sp = sorted_p + static_cast<size_t>(r) * vocab;
  const int* si = sorted_idx + static_cast<size_t>(r) * vocab;
  __shared__ int kept;
  __shared__ double mass;
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int i = 0; i < vocab; ++i) total += row[i];
    const double threshold = top_p[r] * total;
    const int k = (top_k[r] <= 0 || top_k[r] > vocab) ? vocab : top_k[r];
    int n = 0;
    double before = 0.0;
    for (int i = 0; i < k; ++i) {
      if (n > 0 && before >= threshold) break;
      ++n;
      before += sp[i];
    }
    kept = n;
    mass = before;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < draws; d += blockDim.x) {
    const double target = us[static_cast<size_t>(r) * draws + d] * mass;
    double acc = 0.0;
    int pick = si[kept - 1];
    for (int i = 0; i < kept; ++i) {
      acc += sp[i];
      if (acc > target) {
        pick = si[i];
        break;
      }
    }
    out[static_cast<size_t>(r) * draws + d] = pick;
  }
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s INPUT OUTPUT\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[1], "r");
  if (!in) {
    std::perror(argv[1]);
    return 2;
  }
  int rows = 0, vocab = 0, draws = 0;
  if (std::fscanf(in, "%d %d %d", &rows, &vocab, &draws) != 3 || rows <= 0 || vocab <= 0 ||
      draws <= 0) {
    std::fprintf(stderr, "%s: bad header\n", argv[1]);
    return 2;
  }
  std::vector<int> top_k(rows);
  std::vector<double> top_p(rows), probs(static_cast<size_t>(rows) * vocab),
      us(static_cast<size_t>(rows) * draws);
  for (int r = 0; r < rows; ++r) {
    bool ok = std::fscanf(in, "%d %lf", &top_k[r], &top_p[r]) == 2;
    for (int i = 0; ok && i < vocab; ++i) ok = std::fscanf(in, "%lf", &probs[r * vocab + i]) == 1;
    for (int d = 0; ok && d < draws; ++d) ok = std::fscanf(in, "%lf", &us[r * draws + d]) == 1;
    if (!ok) {
      std::fprintf(stderr, "%s: row %d is incomplete\n", argv[1], r);
      return 2;
    }
  }
  std::fclose(in);

  int devices = 0;
  cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "no usable GPU: %s\n",
                 probe != cudaSuccess ? cudaGetErrorName(probe) : "no device");
    return 3;
  }

  const size_t n = static_cast<size_t>(rows) * vocab;
  double *d_probs, *d_sorted_p, *d_top_p, *d_us;
  int *d_idx, *d_sorted_idx, *d_offsets, *d_top_k, *d_out;
  CHECK(cudaMalloc(&d_probs, n * sizeof(double)));
  CHECK(cudaMalloc(&d_sorted_p, n * sizeof(double)));
  CHECK(cudaMalloc(&d_idx, n * sizeof(int)));
  CHECK(cudaMalloc(&d_sorted_idx, n * sizeof(int)));
  CHECK(cudaMalloc(&d_offsets, (rows + 1) * sizeof(int)));
  CHECK(cudaMalloc(&d_top_k, rows * sizeof(int)));
  CHECK(cudaMalloc(&d_top_p, rows * sizeof(double)));
  CHECK(cudaMalloc(&d_us, us.size() * sizeof(double)));
  CHECK(cudaMalloc(&d_out, us.size() * sizeof(int)));
  CHECK(cudaMemcpy(d_probs, probs.data(), n * sizeof(double), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_top_k, top_k.data(), rows * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_top_p, top_p.data(), rows * sizeof(double), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_us, us.data(), us.size() * sizeof(double), cudaMemcpyHostToDevice));

  const int threads = 256;
  const int cells = static_cast<int>(n > static_cast<size_t>(rows) + 1 ? n : rows + 1);
  iota_rows<<<(cells + threads - 1) / threads, threads>>>(d_idx, d_offsets, rows, vocab);
  CHECK(cudaGetLastError());

  size_t temp_bytes = 0;
  CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, temp_bytes, d_probs, d_sorted_p, d_idx, d_sorted_idx, static_cast<int>(n), rows,
      d_offsets, d_offsets + 1));
  void* d_temp = nullptr;
  CHECK(cudaMalloc(&d_temp, temp_bytes));
  CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      d_temp, temp_bytes, d_probs, d_sorted_p, d_idx, d_sorted_idx, static_cast<int>(n), rows,
      d_offsets, d_offsets + 1));

  sample_rows<<<rows, threads>>>(d_probs, d_sorted_p, d_sorted_idx, d_top_k, d_top_p, d_us,
                                 vocab, draws, d_out);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());

  std::vector<int> out(us.size());
  CHECK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(int), cudaMemcpyDeviceToHost));
  FILE* fo = std::fopen(argv[2], "w");
  if (!fo) {
    std::perror(argv[2]);
    return 2;
  }
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < draws; ++d) std::fprintf(fo, d ? " %d" : "%d", out[r * draws + d]);
    std::fputc('\n', fo);
  }
  std::fclose(fo);
  return 0;
}
