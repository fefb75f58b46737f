// The dynamic maps of blockwise 8-bit states ([Note: blockwise 8-bit states]
// in dtype.h), built once in double and rounded to float, so every engine
// reads the same tables.
#include <cmath>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <vector>

#include "dtype.h"

namespace shardadam {
namespace {

// top: the bottom decade's index (6 signed, 7 unsigned); magnitude codes 0 .. 2^(top+1) - 1.
Q8Map build(int top, bool is_signed) {
  Q8Map q{};
  const int codes = 2 << top;
  std::vector<float> magnitude(size_t(codes), 0.0f);
  for (int c = 1; c < codes; ++c) {
    const int k = int(std::floor(std::log2(double(c))));
    const int z = top - k;  // decade: (10^-(z+1), 10^-z], the bottom one down to 0
    const double upper = std::pow(10.0, -z), lower = z < top ? std::pow(10.0, -(z + 1)) : 0.0;
    const int j = c - (1 << k) + 1;  // 1 .. 2^k: the grid point above the lower end
    magnitude[c] = j == (1 << k) ? float(upper) : float(lower + j * (upper - lower) / double(1 << k));
  }
  for (int b = 0; b < 256; ++b)
    q.decode[b] = is_signed ? ((b & 0x80) ? -magnitude[b & 0x7f] : magnitude[b & 0x7f]) : magnitude[b];
  for (int c = 0; c < 256; ++c)
    q.mid[c] = c + 1 < codes ? float((double(magnitude[c]) + double(magnitude[c + 1])) / 2.0)
                             : std::numeric_limits<float>::infinity();
  for (int o = 0; o < kQ8Octaves; ++o) {
    for (int m = 0; m < 256; ++m) {
      const double start = std::ldexp(1.0 + m / 256.0, -o), end = std::ldexp(1.0 + (m + 1) / 256.0, -o);
      int c = 0;  // the code nearest the cell's start: the last whose midpoint below it is passed
      while (c + 1 < codes && double(q.mid[c]) < start) ++c;
      if (c + 1 < codes && double(q.mid[c + 1]) < end)  // a second midpoint inside: one comparison would not do
        throw std::logic_error("q8 map: a cell holds two midpoints");
      q.cell[(o << 8) | m] = uint8_t(c);
    }
  }
  return q;
}

}  // namespace

const Q8Maps& q8_maps() {
  static const Q8Maps maps{{build(6, true), build(7, false)}};
  return maps;
}

const int32_t* q8_cells32(DType d) {
  static const std::vector<std::vector<int32_t>> cells = [] {
    std::vector<std::vector<int32_t>> out;
    for (const Q8Map& q : q8_maps().map) out.emplace_back(std::begin(q.cell), std::end(q.cell));
    return out;
  }();
  return cells[d == DType::Q8U ? 1 : 0].data();
}

}  // namespace shardadam
