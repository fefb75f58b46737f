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
      q.cell[q8_cell_of(o, m)] = uint8_t(c);
    }
  }
  // q8_cell_index sends values past the octaves to a cell at the end of octave 0 or 31: every cell
  // of those octaves must hold one code (the top code and 0), whatever the mantissa.
  for (int m = 0; m < 256; ++m) {
    if (q.cell[q8_cell_of(0, m)] != codes - 1 || q.cell[q8_cell_of(kQ8Octaves - 1, m)] != 0)
      throw std::logic_error("q8 map: a clamped octave holds more than one code");
  }
  return q;
}

}  // namespace

const Q8Maps& q8_maps() {
  static const Q8Maps maps{{build(6, true), build(7, false)}};
  return maps;
}

namespace {

// [Note: settling cells] in dtype.h. Checked at each cell's midpoint and the
// floats next to it, where a wrong entry would settle differently.
std::vector<int32_t> cell_entries(const Q8Map& q) {
  std::vector<int32_t> out(std::size(q.cell));
  for (int o = 0; o < kQ8Octaves; ++o) {
    for (int m = 0; m < 256; ++m) {
      const uint32_t i = q8_cell_of(o, m);
      const uint32_t code = q.cell[i];
      const uint32_t mid_bits = float_bits(q.mid[code]);
      const bool inside = (mid_bits >> 23) == uint32_t(127 - o) && ((mid_bits >> 15) & 0xffu) == uint32_t(m);
      out[size_t(i)] = int32_t(code | ((inside ? (mid_bits & 0x7fffu) : 0xffffu) << 8));
      if (!inside) continue;
      // The first and last octaves also take the exponents beyond them, whose low bits mean nothing here.
      if (o == 0 || o == kQ8Octaves - 1) throw std::logic_error("q8 map: a midpoint in a clamped octave");
      for (const uint32_t y : {mid_bits - 1, mid_bits, mid_bits + 1}) {
        if ((y >> 15) == (mid_bits >> 15) &&  // y in this cell
            q8_settle_bits(y, uint32_t(out[size_t(i)])) != q8_settle(bits_float(y), code, q))
          throw std::logic_error("q8 map: a cell entry settles differently from its midpoint");
      }
    }
  }
  return out;
}

}  // namespace

const int32_t* q8_cell_entries(DType d) {
  static const std::vector<std::vector<int32_t>> entries = [] {
    std::vector<std::vector<int32_t>> out;
    for (const Q8Map& q : q8_maps().map) out.push_back(cell_entries(q));
    return out;
  }();
  return entries[d == DType::Q8U ? 1 : 0].data();
}

}  // namespace shardadam
