// The driver of the fuzz targets in builds without libFuzzer (GCC, the test suite): runs the
// target on every file of the corpus directories given, then on `--mutations N` inputs made
// from them by a fixed-seed mutator (bit flips, byte sets, truncation, duplication, splicing),
// so that the suite replays the seed corpus and a little more on every run. A crash is the
// failure, as under libFuzzer. With libFuzzer (scripts/fuzz.sh) this file is not linked.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::vector<uint8_t> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void Mutate(std::vector<uint8_t>& input, const std::vector<std::vector<uint8_t>>& corpus,
            std::mt19937_64& rng) {
  const int edits = 1 + int(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 5) {
      case 0:
        if (!input.empty()) input[rng() % input.size()] ^= uint8_t(1u << (rng() % 8));
        break;
      case 1:
        if (!input.empty()) input[rng() % input.size()] = uint8_t(rng());
        break;
      case 2:
        if (!input.empty()) input.resize(rng() % input.size());
        break;
      case 3: {
        const size_t at = input.empty() ? 0 : rng() % input.size();
        const size_t n = input.empty() ? 1 : 1 + rng() % input.size();
        std::vector<uint8_t> chunk(n);
        for (auto& b : chunk) b = uint8_t(rng());
        input.insert(input.begin() + long(at), chunk.begin(), chunk.end());
        break;
      }
      case 4: {
        const auto& other = corpus[rng() % corpus.size()];
        if (other.empty()) break;
        const size_t from = rng() % other.size();
        input.insert(input.end(), other.begin() + long(from), other.end());
        break;
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  long mutations = 0;
  std::vector<std::vector<uint8_t>> corpus;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--mutations" && i + 1 < argc) {
      mutations = std::atol(argv[++i]);
      continue;
    }
    const std::filesystem::path path(arg);
    if (std::filesystem::is_directory(path)) {
      for (const auto& entry : std::filesystem::directory_iterator(path)) {
        if (entry.is_regular_file()) corpus.push_back(ReadFile(entry.path()));
      }
    } else {
      corpus.push_back(ReadFile(path));
    }
  }
  if (corpus.empty()) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE... [--mutations N]\n", argv[0]);
    return 2;
  }
  for (const auto& input : corpus) LLVMFuzzerTestOneInput(input.data(), input.size());
  std::mt19937_64 rng(0xc011ec71);
  for (long m = 0; m < mutations; ++m) {
    std::vector<uint8_t> input = corpus[rng() % corpus.size()];
    Mutate(input, corpus, rng);
    LLVMFuzzerTestOneInput(input.data(), input.size());
  }
  std::printf("%zu corpus inputs and %ld mutations ran without a crash\n", corpus.size(),
              mutations);
  return 0;
}
