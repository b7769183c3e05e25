// CDSP prefill planner (Tetris Algorithms 1-3) in C++: the fast twin of prefill/planner.py.
//
// Every decision mirrors the Python reference: the same floating-point expressions in the same order, the same
// orderings ((queue, instance) inside a node, (value, node) between nodes) and the same tie-breaking, so both
// produce identical plans. Python is the readable specification; this file is organised for speed:
//   - one pool per recursion depth, kept sorted by (node, queue, instance); Eq. 2 re-basing is a monotone map, so
//     a child pool is the parent's with its queue times shifted and only the instances that became free re-sorted;
//   - the (s_current, s_next) pairs of Algorithm 1 are explored best-first under exact branch and bound: a pair's
//     key is the child's own single-chunk TTFT (computed in the parent) or a lower bound of its chunked plans,
//     whichever is smaller (see lower_bound), and a pair whose key cannot reach the best plan is never expanded;
//   - sub-problems met twice in one plan call (same pool, initial group, tokens, context, time and SP range) are
//     answered from a memo;
//   - scratch buffers are reused across calls (no allocation once warm).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"

// Results must match the Python reference bit for bit: never fuse a*b+c into one rounding.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace nanocp {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Coeffs {
  double a, b, c, d;
};

// T_s(C, L) = a + b*L + c*C*L + d*L^2, evaluated exactly like LatencyCoeffs.__call__.
inline double eval(const Coeffs& k, double context, double tokens) {
  return k.a + k.b * tokens + k.c * context * tokens + k.d * tokens * tokens;
}

// Largest L in [1, limit] with T(C, L) <= budget, 0 if none (mirror of latency_model.largest_len_within).
long long largest_len_within(const Coeffs& k, long long context, double budget, long long limit) {
  if (limit < 1) return 0;
  const double ctx = static_cast<double>(context);
  if (eval(k, ctx, 1.0) > budget) return 0;
  if (eval(k, ctx, static_cast<double>(limit)) <= budget) return limit;
  const double p = k.b + k.c * ctx;
  const double q = k.a - budget;
  const double root = k.d > 0 ? (-2.0 * q) / (p + std::sqrt(p * p - 4.0 * k.d * q)) : -q / p;
  const double floor_root = std::floor(root);
  long long len = floor_root >= static_cast<double>(limit) ? limit : std::max(1LL, static_cast<long long>(floor_root));
  while (len < limit && eval(k, ctx, static_cast<double>(len + 1)) <= budget) ++len;
  while (len > 1 && eval(k, ctx, static_cast<double>(len)) > budget) --len;
  return len;
}

using Word = std::uint64_t;

inline bool test_bit(const Word* bits, int i) { return (bits[i >> 6] >> (i & 63)) & 1; }
inline void set_bit(Word* bits, int i) { bits[i >> 6] |= Word{1} << (i & 63); }

// The bits of one node's instances (numbered node by node): at most two words.
struct NodeBits {
  int w0, w1;     // word indices (w1 = -1 if the node fits in one word)
  Word m0, m1;    // masks in those words
  bool any(const Word* bits) const { return (bits[w0] & m0) != 0 || (w1 >= 0 && (bits[w1] & m1) != 0); }
  bool all(const Word* bits) const { return (bits[w0] & m0) == m0 && (w1 < 0 || (bits[w1] & m1) == m1); }
  void set(Word* bits) const {
    bits[w0] |= m0;
    if (w1 >= 0) bits[w1] |= m1;
  }
};

struct Member {
  double q;  // queue time, relative to the level's time origin
  int id;    // instance index
  int node;
};

inline bool queue_less(const Member& x, const Member& y) { return x.q != y.q ? x.q < y.q : x.id < y.id; }

struct Segment {
  int node, begin, end;  // members [begin, end) of one node
  int size() const { return end - begin; }
};

// Instances available to one recursion level.
struct Pool {
  std::vector<Member> members;    // grouped by node (ascending), each node by (queue, instance)
  std::vector<Segment> segments;  // one per node present, in node order
  std::vector<int> seg_order;     // segments by (longest queue, node): the order whole nodes are taken

  double longest(int s) const { return members[segments[s].end - 1].q; }

  void build_segments() {
    segments.clear();
    for (int i = 0; i < static_cast<int>(members.size()); ++i) {
      if (segments.empty() || segments.back().node != members[i].node)
        segments.push_back({members[i].node, i, i + 1});
      else
        segments.back().end = i + 1;
    }
    // insertion sort of the segments (in node order) on their longest queue: stable, so ties stay in node order
    seg_order.resize(segments.size());
    for (int s = 0; s < static_cast<int>(segments.size()); ++s) {
      const double q = longest(s);
      int j = s;
      while (j > 0 && q < longest(seg_order[j - 1])) {
        seg_order[j] = seg_order[j - 1];
        --j;
      }
      seg_order[j] = s;
    }
  }

  // This pool = `parent` after Eq. 2, T <- max(0, T - shift). The map is monotone: inside a node only the
  // instances that reach 0 need re-sorting (by instance), and between nodes only the nodes that reach 0 (by node).
  void rebase(const Pool& parent, double shift, int per_node) {
    members.resize(parent.members.size());
    segments.assign(parent.segments.begin(), parent.segments.end());
    for (const Segment& seg : segments) {
      // the instances free by `shift` (T <= shift, so max(0, T - shift) = 0) lead the node, by instance
      int j = seg.begin;
      const Member* from = parent.members.data();
      if (per_node <= 64) {  // the node's instances are a range of ids: order them by a bit mask over it
        const int first_id = seg.node * per_node;
        if (from[seg.end - 1].q <= shift && seg.size() == per_node) {  // the whole node is free
          for (int i = 0; i < per_node; ++i) members[seg.begin + i] = Member{0.0, first_id + i, seg.node};
          continue;
        }
        Word mask = 0;
        for (; j < seg.end && from[j].q <= shift; ++j) mask |= Word{1} << (from[j].id - first_id);
        for (int out = seg.begin; mask != 0; ++out, mask &= mask - 1)
          members[out] = Member{0.0, first_id + __builtin_ctzll(mask), seg.node};
      } else {
        for (; j < seg.end && from[j].q <= shift; ++j) members[j] = Member{0.0, from[j].id, seg.node};
        std::sort(members.begin() + seg.begin, members.begin() + j,
                  [](const Member& x, const Member& y) { return x.id < y.id; });
      }
      for (; j < seg.end; ++j) members[j] = Member{from[j].q - shift, from[j].id, seg.node};
    }
    seg_order.assign(parent.seg_order.begin(), parent.seg_order.end());
    size_t zeros = 0;
    while (zeros < seg_order.size() && longest(seg_order[zeros]) == 0.0) ++zeros;
    std::sort(seg_order.begin(), seg_order.begin() + zeros);
  }
};

// A group as a bitset over instances.
struct Group {
  std::vector<Word> bits;
  int size = 0;
  void reset(int words) {
    bits.assign(words, 0);
    size = 0;
  }
};

// What get_group needs to know about the initial group inside one pool (computed once, reused).
struct InitInfo {
  const Group* group = nullptr;
  double queue = 0.0;             // longest queue of the initial instances (-inf if none)
  std::vector<Member> free_used;  // free instances of the nodes the initial group uses, by (queue, instance)
  std::vector<int> rank;          // per pool segment: position in whole_order, -1 if the segment is in use
  std::vector<int> whole_order;   // unused segments by (longest queue, node): the order whole nodes are taken
  std::vector<int> suffix_len;    // [k] = largest segment size in whole_order[k..]
  bool equal_nodes = true;        // all unused segments have the same size
};

struct ChunkRec {
  long long tokens, context;
  double start, end;
  int mode;
  int bits_begin;
};

struct Plan {
  std::vector<ChunkRec> chunks;
  std::vector<Word> bits;  // words of every chunk's group, back to back
  void clear() {
    chunks.clear();
    bits.clear();
  }
  void push(long long tokens, long long context, const Group& group, double start, double end, int mode) {
    chunks.push_back({tokens, context, start, end, mode, static_cast<int>(bits.size())});
    bits.insert(bits.end(), group.bits.begin(), group.bits.end());
  }
  void append(const Plan& other) {
    const int offset = static_cast<int>(bits.size());
    for (ChunkRec c : other.chunks) {
      c.bits_begin += offset;
      chunks.push_back(c);
    }
    bits.insert(bits.end(), other.bits.begin(), other.bits.end());
  }
  void assign(const Plan& other) {
    chunks.assign(other.chunks.begin(), other.chunks.end());
    bits.assign(other.bits.begin(), other.bits.end());
  }
};

struct Candidate {  // one legal (s_current, s_next) pair of a level, waiting to be explored
  int kc, kn, rank, mode = 0;
  long long len;
  double start, chunk_end, child_t0, key;
  double chunked_key;  // lower bound of the child's chunked plans, NaN if not computed
  int top;             // the child's single-chunk SP size index, -1 if not computed
};

struct Level {  // scratch of one recursion depth
  Pool pool, sub;
  Group group;
  InitInfo init_pool, init_sub, current_sub;
  std::vector<Group> currents;  // current group per s_current
  std::vector<Candidate> candidates;
  std::vector<double> next_queue;  // per size index: longest queue of the group extending the current one
  std::vector<char> next_ok;
  std::vector<double> ready;  // per size index: earliest time any group of that size can be free
  std::vector<double> level_ready;  // the same for groups grown from this level's initial group
  std::vector<double> other;  // scratch: queue times of the nodes the initial group does not use
  Plan best;
};

// A finished sub-problem: its inputs and its answer under `cutoff` (exact when ttft <= cutoff).
struct MemoEntry {
  long long tokens, context;
  double t0, ttft, cutoff;
  int lo, hi;
  std::vector<Word> init;
  std::vector<Member> pool;
  Plan plan;
};

struct Envelope {  // lower envelope of the coefficients over a range of SP sizes (for pruning)
  double a, b, c, m;
};

class CdspPlanner {
 public:
  CdspPlanner(std::vector<std::string> modes,
              std::vector<std::vector<std::tuple<int, double, double, double, double>>> coeffs, int num_nodes,
              int instances_per_node, int max_sp, double improvement_rate, bool chunking,
              long long min_chunk_tokens, std::string policy, int fixed_sp)
      : modes_(std::move(modes)),
        num_nodes_(num_nodes),
        per_node_(instances_per_node),
        rate_(improvement_rate),
        chunking_(chunking),
        min_chunk_tokens_(min_chunk_tokens),
        fixed_sp_(fixed_sp) {
    if (num_nodes < 1 || instances_per_node < 1 || max_sp < 1)
      throw std::invalid_argument("num_nodes, instances_per_node and max_sp must be >= 1");
    if (!(improvement_rate >= 0.0 && improvement_rate < 1.0))
      throw std::invalid_argument("improvement_rate must be in [0, 1)");
    if (min_chunk_tokens < 1) throw std::invalid_argument("min_chunk_tokens must be >= 1");
    if (modes_.empty() || modes_.size() != coeffs.size())
      throw std::invalid_argument("need one coefficient table per attention mode");
    if (policy == "cdsp")
      policy_ = 0;
    else if (policy == "fixed")
      policy_ = 1;
    else if (policy == "elastic")
      policy_ = 2;
    else
      throw std::invalid_argument("policy must be cdsp, fixed or elastic");
    n_ = num_nodes * instances_per_node;
    words_ = (n_ + 63) / 64;
    const int limit = std::min(max_sp, n_);
    for (int s = 1; s <= limit; s *= 2) {
      std::vector<std::pair<int, Coeffs>> per_mode;
      for (size_t m = 0; m < coeffs.size(); ++m)
        for (const auto& [sp, a, b, c, d] : coeffs[m])
          if (sp == s) per_mode.push_back({static_cast<int>(m), Coeffs{a, b, c, d}});
      if (!per_mode.empty()) {
        sizes_.push_back(s);
        by_size_.push_back(per_mode);
      }
    }
    if (sizes_.empty()) throw std::invalid_argument("no power-of-two SP size <= max_sp in the latency models");
    for (size_t m = 0; m < coeffs.size(); ++m)
      for (const auto& [sp, a, b, c, d] : coeffs[m])
        if (sp == fixed_sp) fixed_.push_back({static_cast<int>(m), Coeffs{a, b, c, d}});
    if (policy_ == 1 && (fixed_sp < 1 || fixed_sp > n_ || fixed_.empty()))
      throw std::invalid_argument("fixed policy needs 1 <= fixed_sp <= #instances with latency coefficients");
    build_envelopes();
    for (int node = 0; node < num_nodes; ++node) {  // instances [first, last) of the node
      const int first = node * per_node_, last = first + per_node_;
      if (per_node_ > 64) break;  // nodes wider than a word: NodeBits unused (per-instance bit tests instead)
      NodeBits nb{first >> 6, -1, 0, 0};
      for (int i = first; i < last; ++i) {
        if ((i >> 6) == nb.w0) nb.m0 |= Word{1} << (i & 63);
        else {
          nb.w1 = i >> 6;
          nb.m1 |= Word{1} << (i & 63);
        }
      }
      node_bits_.push_back(nb);
    }
    levels_.resize(sizes_.size() + 2);
    for (Level& lv : levels_) {
      lv.next_queue.assign(sizes_.size(), 0.0);
      lv.next_ok.assign(sizes_.size(), 0);
      lv.ready.assign(sizes_.size(), 0.0);
      lv.level_ready.assign(sizes_.size(), 0.0);
    }
    empty_.reset(words_);
  }

  const std::vector<int>& sizes() const { return sizes_; }
  const std::vector<std::string>& modes() const { return modes_; }

  // Returns (ttft, [(tokens, context, instances, start, end, mode_index)]).
  std::tuple<double, std::vector<std::tuple<long long, long long, std::vector<int>, double, double, int>>> plan(
      long long length, const std::vector<double>& queue) {
    const double ttft = run(length, queue);
    std::vector<std::tuple<long long, long long, std::vector<int>, double, double, int>> out;
    const Plan& best = levels_[0].best;
    for (const ChunkRec& c : best.chunks) {
      std::vector<int> ids;
      for (int i = 0; i < n_; ++i)
        if (test_bit(best.bits.data() + c.bits_begin, i)) ids.push_back(i);
      out.emplace_back(c.tokens, c.context, std::move(ids), c.start, c.end, c.mode);
    }
    return {ttft, out};
  }

  // Planning latency in nanoseconds of every (length, queue row) pair; queues is [len(lengths) * #instances].
  std::vector<double> benchmark(const std::vector<long long>& lengths, const std::vector<double>& queues) {
    if (queues.size() != lengths.size() * static_cast<size_t>(n_))
      throw std::invalid_argument("queues must hold len(lengths) rows of #instances queue times");
    std::vector<double> ns(lengths.size());
    std::vector<double> row(n_);
    for (size_t r = 0; r < lengths.size(); ++r) {
      std::copy(queues.begin() + r * n_, queues.begin() + (r + 1) * n_, row.begin());
      const auto t0 = std::chrono::steady_clock::now();
      run(lengths[r], row);
      const auto t1 = std::chrono::steady_clock::now();
      ns[r] = std::chrono::duration<double, std::nano>(t1 - t0).count();
    }
    return ns;
  }

 private:
  // --- latency model over attention modes ------------------------------------------------------------------
  double prefill(int size_idx, long long context, long long tokens, int& mode) const {
    double best = 0.0;
    bool found = false;
    for (const auto& [m, k] : by_size_[size_idx]) {
      const double t = eval(k, static_cast<double>(context), static_cast<double>(tokens));
      if (!found || t < best) {
        best = t;
        mode = m;
        found = true;
      }
    }
    return best;
  }

  long long solve(int size_idx, long long context, double budget, long long limit) const {
    long long best = 0;
    for (const auto& [m, k] : by_size_[size_idx]) best = std::max(best, largest_len_within(k, context, budget, limit));
    return best;
  }

  // envelope_[lo][hi]: coefficient minima over sizes lo..hi, so a chunk's latency is at least the envelope's.
  // work_[lo][hi]: instance-seconds (s * latency) of chunks on those sizes, one envelope per set of attention modes
  // a plan may use: a = the largest per-chunk overhead s * a_s among the set's modes (a plan that uses a mode runs
  // at least one chunk in it), b, c, m = minima over the set. All keep m <= c / 2, which makes them superadditive
  // over chunks: splitting tokens into chunks never beats them.
  void build_envelopes() {
    const size_t m = sizes_.size();
    const int num_modes = static_cast<int>(modes_.size());
    envelope_.assign(m * m, Envelope{0, 0, 0, 0});
    work_.assign(m * m, {});
    min_a_.assign(m, kInf);
    for (size_t s = 0; s < m; ++s)
      for (const auto& [mode, k] : by_size_[s]) min_a_[s] = std::min(min_a_[s], k.a);
    for (size_t lo = 0; lo < m; ++lo)
      for (size_t hi = lo; hi < m; ++hi) {
        double a = kInf, b = kInf, c = kInf, d = kInf;
        std::vector<Envelope> per_mode(num_modes, Envelope{kInf, kInf, kInf, kInf});  // s * coefficient minima
        for (size_t s = lo; s <= hi; ++s)
          for (const auto& [mode, k] : by_size_[s]) {
            const double size = static_cast<double>(sizes_[s]);
            a = std::min(a, k.a);
            b = std::min(b, k.b);
            c = std::min(c, k.c);
            d = std::min(d, k.d);
            Envelope& w = per_mode[mode];
            w = Envelope{std::min(w.a, size * k.a), std::min(w.b, size * k.b), std::min(w.c, size * k.c),
                         std::min(w.m, size * k.d)};
          }
        envelope_[lo * m + hi] = Envelope{a, b, c, std::min(d, c / 2.0)};
        std::vector<Envelope>& works = work_[lo * m + hi];
        if (num_modes > 4) {  // too many mode sets: one envelope with the smallest overhead (still a bound)
          Envelope w{kInf, kInf, kInf, kInf};
          for (const Envelope& e : per_mode)
            w = Envelope{std::min(w.a, e.a), std::min(w.b, e.b), std::min(w.c, e.c), std::min(w.m, e.m)};
          works.push_back(Envelope{w.a, w.b, w.c, std::min(w.m, w.c / 2.0)});
          continue;
        }
        for (int set = 1; set < (1 << num_modes); ++set) {
          Envelope w{-kInf, kInf, kInf, kInf};
          bool present = true;
          for (int mode = 0; mode < num_modes; ++mode) {
            if (!((set >> mode) & 1)) continue;
            const Envelope& e = per_mode[mode];
            present = present && e.a < kInf;  // the mode has coefficients for some size in the range
            w = Envelope{std::max(w.a, e.a), std::min(w.b, e.b), std::min(w.c, e.c), std::min(w.m, e.m)};
          }
          if (present) works.push_back(Envelope{w.a, w.b, w.c, std::min(w.m, w.c / 2.0)});
        }
        // an envelope no smaller than another in every coefficient adds nothing to the bound
        auto covers = [](const Envelope& x, const Envelope& y) {
          return x.a <= y.a && x.b <= y.b && x.c <= y.c && x.m <= y.m;
        };
        std::vector<Envelope> kept;
        for (size_t i = 0; i < works.size(); ++i) {
          bool redundant = false;
          for (size_t j = 0; j < works.size() && !redundant; ++j)
            redundant = j != i && covers(works[j], works[i]) && (!covers(works[i], works[j]) || j < i);
          if (!redundant) kept.push_back(works[i]);
        }
        works = kept;
      }
  }

  // --- GetGroup ------------------------------------------------------------------------------------------
  void describe_init(const Pool& pool, const Group& init, InitInfo& info) const {
    info.group = &init;
    const int nseg = static_cast<int>(pool.segments.size());
    info.rank.resize(nseg);
    info.free_used.clear();
    double queue = -kInf;
    int used = 0;
    const Word* bits = init.bits.data();
    for (int s = 0; s < nseg; ++s) {
      const Segment& seg = pool.segments[s];
      bool in_use = false;
      if (init.size == 0) {
      } else if (per_node_ <= 64) {  // instances are numbered node by node: a node is a range of bits
        const NodeBits& nb = node_bits_[seg.node];
        in_use = nb.any(bits);
        if (in_use && nb.all(bits)) {  // the whole node is in the group: nothing free there
          info.rank[s] = -1;
          ++used;
          queue = std::max(queue, pool.longest(s));
          continue;
        }
      } else {
        for (int j = seg.begin; j < seg.end && !in_use; ++j) in_use = test_bit(bits, pool.members[j].id);
      }
      info.rank[s] = in_use ? -1 : 0;
      if (!in_use) continue;
      ++used;
      for (int j = seg.begin; j < seg.end; ++j) {
        const Member& m = pool.members[j];
        if (test_bit(bits, m.id))
          queue = std::max(queue, m.q);
        else
          info.free_used.push_back(m);
      }
    }
    info.queue = queue;
    if (used > 1) std::sort(info.free_used.begin(), info.free_used.end(), queue_less);  // merge the nodes
    info.whole_order.clear();
    for (int s : pool.seg_order)
      if (info.rank[s] >= 0) info.whole_order.push_back(s);
    const int k = static_cast<int>(info.whole_order.size());
    info.suffix_len.resize(k + 1);
    info.suffix_len[k] = 0;
    info.equal_nodes = true;
    for (int i = k - 1; i >= 0; --i) {
      const int size = pool.segments[info.whole_order[i]].size();
      info.suffix_len[i] = std::max(info.suffix_len[i + 1], size);
      info.rank[info.whole_order[i]] = i;
      info.equal_nodes = info.equal_nodes && size == pool.segments[info.whole_order[0]].size();
    }
  }

  // Extends the initial group to `size` instances of `pool` (mirror of CdspPlanner._get_group). Sets `queue` to
  // the group's longest queue time; fills `out` only when given (budgets need the queue time alone).
  bool get_group(const Pool& pool, const InitInfo& info, int size, double& queue, Group* out) const {
    const Group& init = *info.group;
    int need = size - init.size;
    if (need < 0 || need > static_cast<int>(pool.members.size()) - init.size) return false;
    double longest = info.queue;  // -inf for an empty initial group
    Word* bits = nullptr;
    if (out != nullptr) {
      out->bits.assign(init.bits.begin(), init.bits.end());
      out->size = size;
      bits = out->bits.data();
    }
    // `count` members sorted by queue; `one_node`: all from one node (then count == per_node_ is all of it)
    auto take = [&](const Member* first, int count, bool one_node) {
      longest = std::max(longest, first[count - 1].q);
      if (bits == nullptr) return;
      if (one_node && count == per_node_ && per_node_ <= 64)
        node_bits_[first[0].node].set(bits);
      else
        for (int t = 0; t < count; ++t) set_bit(bits, first[t].id);
    };
    if (need > 0 && init.size > 0) {  // free instances of the nodes already in use
      const int count = std::min(need, static_cast<int>(info.free_used.size()));
      if (count > 0) take(info.free_used.data(), count, false);
      need -= count;
    }
    // Untouched nodes. Whole nodes go in whole_order until one node can hold the rest; then the node whose
    // need-th shortest queue is smallest takes it (the same decisions as the Python loop).
    int next_whole = 0;
    while (need > 0) {
      if (need <= info.suffix_len[next_whole]) {
        int best = info.whole_order[next_whole];  // nodes of one size, all needed: the first whole node
        if (!info.equal_nodes || need != pool.segments[best].size()) {
          best = -1;
          double best_val = 0.0;
          for (size_t i = next_whole; i < info.whole_order.size(); ++i) {  // the untouched nodes left
            const int s = info.whole_order[i];
            const Segment& seg = pool.segments[s];
            if (seg.size() < need) continue;
            const double v = pool.members[seg.begin + need - 1].q;
            if (best < 0 || v < best_val || (v == best_val && s < best)) {  // ties: node order
              best = s;
              best_val = v;
            }
          }
        }
        take(&pool.members[pool.segments[best].begin], need, true);
        break;
      }
      const Segment& seg = pool.segments[info.whole_order[next_whole++]];
      take(&pool.members[seg.begin], seg.size(), true);
      need -= seg.size();
    }
    queue = longest;
    return true;
  }

  // sub = members of `pool` that are in `group`, same order.
  static void restrict_pool(const Pool& pool, const Group& group, Pool& sub) {
    sub.members.clear();
    for (const Member& m : pool.members)
      if (test_bit(group.bits.data(), m.id)) sub.members.push_back(m);
    sub.build_segments();
  }

  // --- Algorithms 1-3 ------------------------------------------------------------------------------------
  // Fills levels_[depth].best with the chunks of the remaining `tokens` and returns the plan's TTFT.
  // levels_[depth].pool holds queue times relative to absolute time t0; the SP sizes are sizes_[lo..hi].
  //
  // The pairs of Algorithm 1 are explored best-first (by a lower bound of their TTFT) with branch and bound;
  // ties go to the earlier pair in the paper's order (s_current, then s_next, ascending), after the single-chunk
  // plan. The result is exactly the sequential algorithm's: the earliest plan with the smallest TTFT. `cutoff`:
  // the caller only needs the result if its TTFT is <= cutoff; otherwise any value > cutoff may be returned.
  // `chunked_key`: a lower bound of this level's chunked plans if the caller has one (NaN otherwise); `single_top`:
  // the SP size index Algorithm 2 picks here if the caller already knows it (-1 otherwise).
  double schedule(int depth, long long tokens, long long context, const Group& init, int lo, int hi, double t0,
                  double cutoff, double chunked_key, int single_top) {
    Level& lv = levels_[depth];
    // Algorithm 2: one chunk; SP grows only for a TTFT gain above the improvement rate.
    describe_init(lv.pool, init, lv.init_pool);
    int opt_idx = single_top, opt_mode = 0;
    double opt_prefill = 0.0;
    if (opt_idx < 0) {
      double opt_ttft = kInf;
      for (int k = lo; k <= hi; ++k) {
        double queue = 0.0;
        if (!get_group(lv.pool, lv.init_pool, sizes_[k], queue, nullptr)) continue;
        int mode = 0;
        const double pre = prefill(k, context, tokens, mode);
        const double ttft = queue + pre;
        if (ttft < opt_ttft * (1.0 - rate_)) {
          opt_ttft = ttft;
          opt_idx = k;
          opt_mode = mode;
          opt_prefill = pre;
        }
      }
      if (opt_idx < 0) throw std::invalid_argument("no SP size fits the prefill pool");
    } else {
      opt_prefill = prefill(opt_idx, context, tokens, opt_mode);
    }
    double opt_queue = 0.0;
    get_group(lv.pool, lv.init_pool, sizes_[opt_idx], opt_queue, &lv.group);
    const double end_rel = opt_queue + opt_prefill;
    double best_ttft = t0 + end_rel;
    lv.best.clear();
    lv.best.push(tokens, context, lv.group, t0 + opt_queue, t0 + end_rel, opt_mode);
    if (!chunking_) return best_ttft;

    // Algorithm 1, step 1: (s_current, s_next) pairs inside the single-chunk group.
    const int cdsp_hi = opt_idx;  // sizes ascend: the largest size that fits the single-chunk group is its own
    if (cdsp_hi == lo) return best_ttft;
    // Stop here if no chunked plan can beat the single-chunk plan (or reach the caller's cutoff).
    if (std::isnan(chunked_key)) {
      ready_times(lv.pool, lv.init_pool, lo, cdsp_hi, lv.ready, lv.other);
      if (cannot_reach(lo, cdsp_hi, tokens, context, lv.ready, t0, std::min(cutoff, best_ttft))) return best_ttft;
    } else if (beyond(chunked_key, std::min(cutoff, best_ttft))) {
      return best_ttft;
    }
    if (depth > 0) {
      const MemoEntry* hit = memo_find(lv, tokens, context, init, lo, hi, t0, cutoff);
      if (hit != nullptr) {
        lv.best.assign(hit->plan);
        return hit->ttft;
      }
    }
    const double ttft = explore_pairs(depth, tokens, context, init, lo, cdsp_hi, t0, cutoff, best_ttft);
    if (depth > 0) memo_store(lv, tokens, context, init, lo, hi, t0, cutoff, ttft);
    return ttft;
  }

  // Algorithm 1's loop over (s_current, s_next) pairs of sizes_[lo..cdsp_hi] inside the single-chunk group
  // (lv.group), starting from the single-chunk plan in lv.best with TTFT best_ttft.
  double explore_pairs(int depth, long long tokens, long long context, const Group& init, int lo, int cdsp_hi,
                       double t0, double cutoff, double best_ttft) {
    Level& lv = levels_[depth];
    // the pool restricted to the single-chunk group (the whole pool when the group is all of it)
    const bool whole_pool = lv.group.size == static_cast<int>(lv.pool.members.size());
    if (!whole_pool) restrict_pool(lv.pool, lv.group, lv.sub);
    const Pool& sub = whole_pool ? lv.pool : lv.sub;
    if (!whole_pool) describe_init(sub, init, lv.init_sub);
    const InitInfo& init_sub = whole_pool ? lv.init_pool : lv.init_sub;
    lv.candidates.clear();
    if (static_cast<int>(lv.currents.size()) < cdsp_hi - lo + 1) lv.currents.resize(cdsp_hi - lo + 1);
    ready_times(sub, init_sub, lo, cdsp_hi, lv.level_ready, lv.other);
    for (int kc = lo; kc < cdsp_hi; ++kc) {
      // every chunk of a plan that starts on s_current has at least s_current instances
      if (kc > lo && cannot_reach(kc, cdsp_hi, tokens, context, lv.level_ready, t0, std::min(cutoff, best_ttft)))
        continue;
      Group& current = lv.currents[kc - lo];
      double queue_cur = 0.0;
      if (!get_group(sub, init_sub, sizes_[kc], queue_cur, &current)) continue;
      describe_init(sub, current, lv.current_sub);
      ready_times(sub, lv.current_sub, kc + 1, cdsp_hi, lv.ready, lv.other);
      // Longest queue of the group extending `current` to each larger size: Algorithm 3's budgets, and also what
      // the child's Algorithm 2 sees after Eq. 2 (the monotone map leaves these maxima unchanged unless it ties
      // untouched nodes of different sizes at zero).
      for (int k = kc + 1; k <= cdsp_hi; ++k)
        lv.next_ok[k] = get_group(sub, lv.current_sub, sizes_[k], lv.next_queue[k], nullptr);
      const std::vector<int>& order = lv.current_sub.whole_order;
      long long last_len = -1;  // the previous legal pair of this s_current with a known child single-chunk size
      int last_top = -1;
      for (int kn = kc + 1; kn <= cdsp_hi; ++kn) {
        if (!lv.next_ok[kn]) continue;
        // Algorithm 3: the chunk may run until the larger group frees up.
        const double budget = lv.next_queue[kn] - queue_cur;
        const long long len = solve(kc, context, budget, tokens);
        if (len >= tokens || len < std::max(min_chunk_tokens_, 2LL * sizes_[kc])) continue;
        Candidate c;
        c.kc = kc;
        c.kn = kn;
        c.rank = kc * 64 + kn;
        c.len = len;
        c.start = t0 + queue_cur;
        c.chunk_end = queue_cur + prefill(kc, context, len, c.mode);
        c.child_t0 = t0 + c.chunk_end;
        c.chunked_key = std::numeric_limits<double>::quiet_NaN();
        c.top = -1;
        const long long rest = tokens - len, next_context = context + len;
        const bool exact_queues = lv.current_sub.equal_nodes || order.size() < 2 ||
                                  sub.longest(order[1]) > c.chunk_end;
        if (exact_queues) {
          // The child's Algorithm 2, exactly as the child will compute it: its single-chunk TTFT is one of its
          // results, and its chunked plans only use sizes up to its single-chunk size.
          double opt = kInf;
          int top = kn;
          for (int k = kn; k <= cdsp_hi; ++k) {
            if (!lv.next_ok[k]) continue;
            int mode = 0;
            const double ttft = std::max(0.0, lv.next_queue[k] - c.chunk_end) + prefill(k, next_context, rest, mode);
            if (ttft < opt * (1.0 - rate_)) {
              opt = ttft;
              top = k;
            }
          }
          // Same chunk and same child single-chunk size as the previous pair: that child has every plan this one
          // has (its sizes start lower) and comes first in the paper's order, so this pair can never win.
          if (len == last_len && top == last_top) continue;
          last_len = len;
          last_top = top;
          c.top = top;
          c.key = c.child_t0 + opt;
          if (top > kn) {
            c.chunked_key =
                c.child_t0 + lower_bound(kn, top, rest, next_context, lv.ready, c.chunk_end) * (1.0 - 1e-9);
            c.key = std::min(c.key, c.chunked_key);
          }
        } else {
          c.key = c.child_t0 + lower_bound(kn, cdsp_hi, rest, next_context, lv.ready, c.chunk_end) * (1.0 - 1e-9);
        }
        if (!beyond(c.key, std::min(cutoff, best_ttft))) lv.candidates.push_back(c);
      }
    }
    std::sort(lv.candidates.begin(), lv.candidates.end(), [](const Candidate& x, const Candidate& y) {
      return x.key != y.key ? x.key < y.key : x.rank < y.rank;
    });
    Level& child = levels_[depth + 1];
    int best_rank = -1;  // the single-chunk plan comes first in the paper's order
    for (const Candidate& c : lv.candidates) {
      const double bound = std::min(cutoff, best_ttft);
      if (beyond(c.key, bound)) break;  // sorted by key: no later pair can reach the bound either
      child.pool.rebase(sub, c.chunk_end, per_node_);  // Eq. 2: queue times re-based on the end of this chunk
      const Group& current = lv.currents[c.kc - lo];
      const double ttft = schedule(depth + 1, tokens - c.len, context + c.len, current, c.kn, cdsp_hi, c.child_t0,
                                   bound, c.chunked_key, c.top);
      if (ttft < best_ttft || (ttft == best_ttft && c.rank < best_rank)) {
        best_ttft = ttft;
        best_rank = c.rank;
        lv.best.clear();
        lv.best.push(c.len, context, current, c.start, c.child_t0, c.mode);
        lv.best.append(child.best);
      }
    }
    return best_ttft;
  }

  // --- memo of sub-problems --------------------------------------------------------------------------------
  const MemoEntry* memo_find(const Level& lv, long long tokens, long long context, const Group& init, int lo,
                             int hi, double t0, double cutoff) const {
    for (size_t i = 0; i < memo_used_; ++i) {
      const MemoEntry& e = memo_[i];
      if (e.tokens != tokens || e.context != context || e.t0 != t0 || e.lo != lo || e.hi != hi) continue;
      if (!(e.ttft <= e.cutoff || cutoff <= e.cutoff)) continue;  // neither exact nor decided for this cutoff
      if (e.pool.size() != lv.pool.members.size() || !std::equal(e.init.begin(), e.init.end(), init.bits.begin()))
        continue;
      if (std::memcmp(e.pool.data(), lv.pool.members.data(), e.pool.size() * sizeof(Member)) != 0) continue;
      return &e;
    }
    return nullptr;
  }

  void memo_store(const Level& lv, long long tokens, long long context, const Group& init, int lo, int hi,
                  double t0, double cutoff, double ttft) {
    if (memo_used_ == memo_.size()) memo_.emplace_back();
    MemoEntry& e = memo_[memo_used_++];
    e.tokens = tokens;
    e.context = context;
    e.t0 = t0;
    e.ttft = ttft;
    e.cutoff = cutoff;
    e.lo = lo;
    e.hi = hi;
    e.init.assign(init.bits.begin(), init.bits.end());
    e.pool.assign(lv.pool.members.begin(), lv.pool.members.end());
    e.plan.assign(lv.best);
  }

  // --- pruning bounds --------------------------------------------------------------------------------------
  // A plan whose TTFT is at least `key` (up to the margin folded into it) cannot reach `bound`.
  static bool beyond(double key, double bound) { return key > bound * (1.0 + 1e-12); }

  // ready[k] (k in [lo, hi]): a lower bound of the longest queue of any group of size sizes_[k] that a chain of
  // GetGroup calls can build from the initial group described by `info`. Such a group either stays inside the
  // initial group's nodes (then it holds the shortest free queues there), or holds all of those nodes plus, from
  // every other node, its shortest queues. GetGroup only adds a node partly when the remaining need is smaller
  // than a node, and fills that node before taking new ones; so if every other node has the same size k and every
  // size s with s - own >= k has s - own a multiple of k, the other nodes come whole beyond one partial node.
  void ready_times(const Pool& pool, const InitInfo& info, int lo, int hi, std::vector<double>& ready,
                   std::vector<double>& other) const {
    const int init_size = info.group->size;
    const int own = init_size + static_cast<int>(info.free_used.size());  // instances of the initial nodes
    double own_max = info.queue;
    if (!info.free_used.empty()) own_max = std::max(own_max, info.free_used.back().q);
    const int node_size = info.whole_order.empty() ? 0 : pool.segments[info.whole_order[0]].size();
    bool whole = info.equal_nodes && node_size > 0;
    for (int k = lo; k <= hi && whole; ++k)
      if (sizes_[k] - own >= node_size && (sizes_[k] - own) % node_size != 0) whole = false;
    bool sorted_other = false;
    for (int k = lo; k <= hi; ++k) {
      const int s = sizes_[k];
      if (s <= init_size) {
        ready[k] = info.queue;
      } else if (s <= own) {
        ready[k] = std::max(info.queue, info.free_used[s - init_size - 1].q);
      } else if (s - own > static_cast<int>(pool.members.size()) - own) {
        ready[k] = kInf;  // no group of this size exists
      } else if (whole && s - own < node_size) {  // part of one more node
        double shortest = kInf;
        for (int seg : info.whole_order) shortest = std::min(shortest, pool.members[pool.segments[seg].begin + s - own - 1].q);
        ready[k] = std::max(own_max, shortest);
      } else if (whole) {
        ready[k] = std::max(own_max, pool.longest(info.whole_order[(s - own) / node_size - 1]));
      } else {
        if (!sorted_other) {
          other.clear();
          for (int seg : info.whole_order)
            for (int j = pool.segments[seg].begin; j < pool.segments[seg].end; ++j) other.push_back(pool.members[j].q);
          std::sort(other.begin(), other.end());
          sorted_other = true;
        }
        ready[k] = std::max(own_max, other[s - own - 1]);
      }
    }
  }

  // Whether no plan of the remaining `tokens` on sizes_[lo..hi], starting at t0, can reach `bound`.
  bool cannot_reach(int lo, int hi, long long tokens, long long context, const std::vector<double>& ready, double t0,
                    double bound) const {
    const double stop = (bound * (1.0 + 1e-12) - t0) / (1.0 - 1e-9);
    return beyond(t0 + lower_bound(lo, hi, tokens, context, ready, 0.0, stop) * (1.0 - 1e-9), bound);
  }

  // Lower bound of the TTFT (relative to the level's origin, after Eq. 2 by `shift`) of any plan of the remaining
  // `tokens` whose chunks use sizes_[lo..hi], given the ready times of those sizes. For a plan whose last chunk
  // has s_f instances:
  //   - all its work runs after the first chunk's group is ready, at no less than the envelope of Eq. 1;
  //   - the last chunk starts once its group is ready; before that, the earlier (smaller) chunks can do at most
  //     the work that fits in the instance-seconds of the groups ready by then (each chunk runs on at most the
  //     largest size ready when it starts), less one chunk overhead per attention mode they use, and every token
  //     left over runs in the last chunk -- or the last chunk starts later, by the extra work divided by the
  //     largest earlier size.
  // The bound is the smallest over s_f; it never exceeds any plan's TTFT, so pruning with it changes nothing.
  // With `stop`, returns -inf as soon as some s_f gives a value <= stop (callers that only compare with stop).
  double lower_bound(int lo, int hi, long long tokens, long long context, const std::vector<double>& ready,
                     double shift, double stop = -kInf) const {
    const double rest = static_cast<double>(tokens);
    const double ctx = static_cast<double>(context);
    const size_t m = sizes_.size();
    double r[64], e[64];  // re-based ready times; e[k] = earliest ready time of any size in [k, f)
    for (int k = lo; k <= hi; ++k) r[k] = std::max(0.0, ready[k] - shift);
    double lower = kInf;
    for (int f = hi; f >= lo; --f) {  // large last chunks first: they usually give the bound, the rest is skipped
      const Envelope& w = envelope_[lo * m + f];
      const double work = r[lo] + w.a + w.b * rest + w.c * ctx * rest + w.m * rest * rest;
      if (work >= lower || r[f] + min_a_[f] >= lower) continue;
      double tail;
      if (f == lo) {
        tail = r[f] + last_chunk_min(f, ctx, rest, 0.0, 0.0, 0.0, 0.0, 0.0);
      } else {
        double earliest = kInf;
        for (int k = f - 1; k >= lo; --k) e[k] = earliest = std::min(earliest, r[k]);
        double cap = 0.0;  // instance-seconds of sizes < s_f before r[f]
        for (int k = lo; k < f; ++k)
          cap += static_cast<double>(sizes_[k] - (k > lo ? sizes_[k - 1] : 0)) * std::max(0.0, r[f] - e[k]);
        // X > 0 tokens before the last chunk take at least one chunk in each mode used: overheads and work
        const std::vector<Envelope>& works = work_[lo * m + f - 1];
        double x1 = 0.0;  // most tokens done by r[f]
        for (const Envelope& pw : works) {
          const double avail = cap - pw.a;
          if (avail <= 0.0) continue;
          const double p = pw.b + pw.c * ctx;
          const double root = p + std::sqrt(p * p + 4.0 * pw.m * avail);
          x1 = std::max(x1, root > 0.0 ? std::min(rest, 2.0 * avail / root) : rest);
        }
        tail = r[f] + last_chunk_min(f, ctx, rest, 0.0, x1, 0.0, 0.0, 0.0);
        if (x1 < rest) {
          const double inv = 1.0 / static_cast<double>(sizes_[f - 1]);
          for (const Envelope& pw : works) {
            const double p = pw.b + pw.c * ctx;
            tail = std::min(tail, r[f] + last_chunk_min(f, ctx, rest, x1, rest, (pw.a - cap) * inv, p * inv,
                                                        pw.m * inv));
          }
        }
      }
      lower = std::min(lower, std::max(work, tail));
      if (lower <= stop) return -kInf;
    }
    return lower;
  }

  // min over X in [x0, x1] of T_f(C + X, L - X) + e0 + e1 X + e2 X^2 (a quadratic in X): the last chunk's latency
  // after X tokens ran earlier, plus the delay that work adds.
  double last_chunk_min(int f, double ctx, double rest, double x0, double x1, double e0, double e1,
                        double e2) const {
    double best = kInf;
    for (const auto& [mode, k] : by_size_[f]) {
      auto value = [&](double x) { return eval(k, ctx + x, rest - x) + e0 + e1 * x + e2 * x * x; };
      const double q2 = k.d - k.c + e2;
      const double q1 = -k.b + k.c * (rest - ctx) - 2.0 * k.d * rest + e1;
      double v = std::min(value(x0), value(x1));
      if (q2 > 0) {
        const double xv = -q1 / (2.0 * q2);
        if (xv > x0 && xv < x1) v = std::min(v, value(xv));
      }
      best = std::min(best, v);
    }
    return best;
  }

  // --- baselines -----------------------------------------------------------------------------------------
  void push_contiguous(Plan& plan, long long length, const std::vector<int>& ids, double start, double end,
                       int mode) {
    Group& g = levels_[0].group;
    g.reset(words_);
    for (int i : ids) set_bit(g.bits.data(), i);
    g.size = static_cast<int>(ids.size());
    plan.clear();
    plan.push(length, 0, g, start, end, mode);
  }

  double fixed(long long length, const std::vector<double>& queue) {
    const int groups = n_ / fixed_sp_;
    int best_g = 0;
    double best_q = 0.0;
    for (int g = 0; g < groups; ++g) {
      double q = queue[g * fixed_sp_];
      for (int i = g * fixed_sp_; i < (g + 1) * fixed_sp_; ++i) q = std::max(q, queue[i]);
      if (g == 0 || q < best_q) {
        best_q = q;
        best_g = g;
      }
    }
    double pre = 0.0;
    int mode = 0;
    bool found = false;
    for (const auto& [m, k] : fixed_) {
      const double t = eval(k, 0.0, static_cast<double>(length));
      if (!found || t < pre) {
        pre = t;
        mode = m;
        found = true;
      }
    }
    ids_.clear();
    for (int i = best_g * fixed_sp_; i < (best_g + 1) * fixed_sp_; ++i) ids_.push_back(i);
    const double end = best_q + pre;
    push_contiguous(levels_[0].best, length, ids_, best_q, end, mode);
    return end;
  }

  double elastic(long long length, const std::vector<double>& queue) {
    std::vector<int> order(n_);
    for (int i = 0; i < n_; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&queue](int x, int y) {
      if (queue[x] != queue[y]) return queue[x] < queue[y];
      return x < y;
    });
    double best_end = 0.0;
    for (size_t k = 0; k < sizes_.size(); ++k) {
      ids_.assign(order.begin(), order.begin() + sizes_[k]);
      std::sort(ids_.begin(), ids_.end());
      double q = queue[ids_[0]];
      for (int i : ids_) q = std::max(q, queue[i]);
      int mode = 0;
      const double end = q + prefill(static_cast<int>(k), 0, length, mode);
      if (k == 0 || end <= best_end) {
        best_end = end;
        push_contiguous(levels_[0].best, length, ids_, q, end, mode);
      }
    }
    return best_end;
  }

  double run(long long length, const std::vector<double>& queue) {
    if (length < 1) throw std::invalid_argument("length must be >= 1");
    if (static_cast<int>(queue.size()) != n_) throw std::invalid_argument("expected one queue time per instance");
    for (double q : queue)
      if (!(q >= 0.0) || !std::isfinite(q)) throw std::invalid_argument("queue times must be finite and >= 0");
    if (policy_ == 1) return fixed(length, queue);
    if (policy_ == 2) return elastic(length, queue);
    Pool& pool = levels_[0].pool;
    pool.members.resize(n_);
    for (int i = 0; i < n_; ++i) pool.members[i] = Member{queue[i], i, i / per_node_};
    for (int node = 0; node < num_nodes_; ++node) {  // instances are numbered node by node: insertion sort each
      Member* first = pool.members.data() + node * per_node_;
      for (int i = 1; i < per_node_; ++i) {
        const Member m = first[i];
        int j = i;
        for (; j > 0 && queue_less(m, first[j - 1]); --j) first[j] = first[j - 1];
        first[j] = m;
      }
    }
    pool.build_segments();
    memo_used_ = 0;
    return schedule(0, length, 0, empty_, 0, static_cast<int>(sizes_.size()) - 1, 0.0, kInf,
                    std::numeric_limits<double>::quiet_NaN(), -1);
  }

  std::vector<std::string> modes_;
  int num_nodes_, per_node_, n_ = 0, words_ = 1;
  double rate_;
  bool chunking_;
  long long min_chunk_tokens_;
  int policy_ = 0, fixed_sp_;
  std::vector<int> sizes_;
  std::vector<std::vector<std::pair<int, Coeffs>>> by_size_;  // per candidate size: (mode, coeffs)
  std::vector<std::pair<int, Coeffs>> fixed_;
  std::vector<Envelope> envelope_;  // [lo * #sizes + hi]
  std::vector<double> min_a_;       // per size index: the smallest overhead a over attention modes
  std::vector<std::vector<Envelope>> work_;  // [lo * #sizes + hi]: one per set of attention modes
  std::vector<NodeBits> node_bits_;  // per node, when instances_per_node <= 64
  std::vector<Level> levels_;
  std::vector<MemoEntry> memo_;  // entries [0, memo_used_) belong to the current plan call
  size_t memo_used_ = 0;
  Group empty_;
  std::vector<int> ids_;
};

}  // namespace

void bind_cdsp(nb::module_& m) {
  nb::class_<CdspPlanner>(m, "CdspPlanner",
                          "CDSP prefill planner core (mirror of nanocp.prefill.planner.CdspPlanner)")
      .def(nb::init<std::vector<std::string>,
                    std::vector<std::vector<std::tuple<int, double, double, double, double>>>, int, int, int, double,
                    bool, long long, std::string, int>(),
           nb::arg("modes"), nb::arg("coeffs"), nb::arg("num_nodes"), nb::arg("instances_per_node"),
           nb::arg("max_sp"), nb::arg("improvement_rate"), nb::arg("chunking"), nb::arg("min_chunk_tokens"),
           nb::arg("policy"), nb::arg("fixed_sp"))
      .def_prop_ro("sizes", &CdspPlanner::sizes)
      .def_prop_ro("modes", &CdspPlanner::modes)
      .def("plan", &CdspPlanner::plan, nb::arg("length"), nb::arg("queue_times"),
           "-> (ttft, [(tokens, context, instances, start, end, mode_index)])")
      .def("benchmark", &CdspPlanner::benchmark, nb::arg("lengths"), nb::arg("queues"),
           "planning latency (ns) per (length, queue row); queues flattened row-major");
}

}  // namespace nanocp
