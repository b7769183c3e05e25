// CDSP prefill planner (Tetris Algorithms 1-3) in C++: the fast twin of prefill/planner.py.
//
// Every decision mirrors the Python reference: the same floating-point expressions in the same order, the same
// orderings ((queue, instance) inside a node, (value, node) between nodes) and the same tie-breaking, so both
// produce identical plans. Python is the readable specification; this file is organised for speed: one pool per
// recursion depth kept sorted by (node, queue, instance), scratch buffers reused across calls.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
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

struct Member {
  double q;  // queue time, relative to the level's time origin
  int id;    // instance index
  int node;
};

// (node, queue, instance): the order in which a level keeps its pool.
inline bool member_less(const Member& x, const Member& y) {
  if (x.node != y.node) return x.node < y.node;
  if (x.q != y.q) return x.q < y.q;
  return x.id < y.id;
}

// (queue, instance): the order of instances inside one node.
inline bool queue_less(const Member& x, const Member& y) {
  if (x.q != y.q) return x.q < y.q;
  return x.id < y.id;
}

struct Segment {
  int node, begin, end;  // members [begin, end) of one node
};

struct Pool {
  std::vector<Member> members;   // sorted by member_less
  std::vector<Segment> segments;  // one per node present, in node order
  std::vector<int> seg_order;     // segments by (longest queue, node): the order whole nodes are taken
  std::vector<int> seg_of_node;   // node -> segment, -1 if absent
  std::vector<int> pos;           // instance -> position in members (valid for members)
  std::vector<std::pair<double, int>> by_queue;  // (queue, instance) ascending in queue (ties in any order)

  void index(int num_nodes, int num_instances) {
    segments.clear();
    for (int i = 0; i < static_cast<int>(members.size()); ++i) {
      if (segments.empty() || segments.back().node != members[i].node)
        segments.push_back({members[i].node, i, i + 1});
      else
        segments.back().end = i + 1;
    }
    seg_of_node.assign(num_nodes, -1);
    pos.resize(num_instances);
    for (int s = 0; s < static_cast<int>(segments.size()); ++s) {
      seg_of_node[segments[s].node] = s;
      for (int j = segments[s].begin; j < segments[s].end; ++j) pos[members[j].id] = j;
    }
    // insertion sort of segments (in node order) on the queue: stable, so ties stay in node order
    seg_order.resize(segments.size());
    for (int s = 0; s < static_cast<int>(segments.size()); ++s) {
      const double q = members[segments[s].end - 1].q;
      int j = s;
      while (j > 0 && q < members[segments[seg_order[j - 1]].end - 1].q) {
        seg_order[j] = seg_order[j - 1];
        --j;
      }
      seg_order[j] = s;
    }
  }
  // Restore the order after a monotone change of queue times (nearly sorted: insertion sort).
  void resort() {
    for (size_t i = 1; i < members.size(); ++i) {
      const Member m = members[i];
      size_t j = i;
      while (j > 0 && member_less(m, members[j - 1])) {
        members[j] = members[j - 1];
        --j;
      }
      members[j] = m;
    }
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
  double queue = 0.0;             // max queue of the initial instances
  std::vector<Member> free_used;  // free instances of the nodes the initial group uses, by (queue, instance)
  std::vector<int> rank;          // per pool segment: position in whole_order, -1 if the segment is in use
  std::vector<int> whole_order;   // unused segments by (longest queue, node): the order whole nodes are taken
  std::vector<int> suffix_len;    // [k] = largest segment size in whole_order[k..]
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
};

struct Candidate {  // one legal (s_current, s_next) pair of a level, waiting to be explored
  int kc, kn, rank, mode = 0;
  long long len;
  double start, chunk_end, child_t0, key;
};

struct Level {  // scratch of one recursion depth
  Pool pool, sub;
  Group group;
  InitInfo init_pool, init_sub, current_sub;
  std::vector<Group> currents;     // current group per s_current
  std::vector<Candidate> candidates;
  Plan best;
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
    levels_.resize(sizes_.size() + 2);
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

  double min_a(int size_idx) const {
    double a = std::numeric_limits<double>::infinity();
    for (const auto& [m, k] : by_size_[size_idx]) a = std::min(a, k.a);
    return a;
  }

  void build_envelopes() {
    const size_t m = sizes_.size();
    const double inf = std::numeric_limits<double>::infinity();
    envelope_.assign(m * m, Envelope{0, 0, 0, 0});
    for (size_t lo = 0; lo < m; ++lo)
      for (size_t hi = lo; hi < m; ++hi) {
        double a = inf, b = inf, c = inf, d = inf;
        for (size_t s = lo; s <= hi; ++s)
          for (const auto& [mode, k] : by_size_[s]) {
            a = std::min(a, k.a);
            b = std::min(b, k.b);
            c = std::min(c, k.c);
            d = std::min(d, k.d);
          }
        envelope_[lo * m + hi] = Envelope{a, b, c, std::min(d, c / 2.0)};
      }
  }

  // --- GetGroup ------------------------------------------------------------------------------------------
  void describe_init(const Pool& pool, const Group& init, InitInfo& info) const {
    info.group = &init;
    const int nseg = static_cast<int>(pool.segments.size());
    info.rank.assign(nseg, 0);
    info.queue = -std::numeric_limits<double>::infinity();
    for (int w = 0; w < words_; ++w)
      for (Word bits = init.bits[w]; bits != 0; bits &= bits - 1) {
        const int id = w * 64 + __builtin_ctzll(bits);
        info.rank[pool.seg_of_node[id / per_node_]] = -1;
        info.queue = std::max(info.queue, pool.members[pool.pos[id]].q);
      }
    info.free_used.clear();
    info.whole_order.clear();
    for (int s = 0; s < nseg; ++s)
      if (info.rank[s] < 0)
        for (int j = pool.segments[s].begin; j < pool.segments[s].end; ++j)
          if (!test_bit(init.bits.data(), pool.members[j].id)) info.free_used.push_back(pool.members[j]);
    std::sort(info.free_used.begin(), info.free_used.end(), queue_less);
    for (int s : pool.seg_order)
      if (info.rank[s] >= 0) info.whole_order.push_back(s);
    const int k = static_cast<int>(info.whole_order.size());
    info.suffix_len.assign(k + 1, 0);
    for (int i = k - 1; i >= 0; --i) {
      const Segment& seg = pool.segments[info.whole_order[i]];
      info.suffix_len[i] = std::max(info.suffix_len[i + 1], seg.end - seg.begin);
      info.rank[info.whole_order[i]] = i;
    }
  }

  // Extends the initial group to `size` instances of `pool` (mirror of CdspPlanner._get_group). Sets `queue` to
  // the group's longest queue time; fills `out` only when given (budgets need the queue time alone).
  bool get_group(const Pool& pool, const InitInfo& info, int size, double& queue, Group* out) const {
    const Group& init = *info.group;
    int need = size - init.size;
    if (need < 0 || need > static_cast<int>(pool.members.size()) - init.size) return false;
    queue = info.queue;  // -inf for an empty initial group
    if (out != nullptr) {
      out->bits.assign(init.bits.begin(), init.bits.end());
      out->size = size;
    }
    auto take = [&](const Member* first, int count) {  // `count` members sorted by queue
      queue = std::max(queue, first[count - 1].q);
      if (out != nullptr)
        for (int t = 0; t < count; ++t) set_bit(out->bits.data(), first[t].id);
    };
    if (need > 0 && init.size > 0) {  // free instances of the nodes already in use
      const int count = std::min(need, static_cast<int>(info.free_used.size()));
      if (count > 0) take(info.free_used.data(), count);
      need -= count;
    }
    // Untouched nodes. Whole nodes go in whole_order until one node can hold the rest; then the node whose
    // need-th shortest queue is smallest takes it (the same decisions as the Python loop).
    int next_whole = 0;
    while (need > 0) {
      if (need <= info.suffix_len[next_whole]) {
        int best = -1;
        double best_val = 0.0;
        for (int s = 0; s < static_cast<int>(pool.segments.size()); ++s) {
          const Segment& seg = pool.segments[s];
          if (info.rank[s] < next_whole || seg.end - seg.begin < need) continue;  // in use or taken
          const double v = pool.members[seg.begin + need - 1].q;
          if (best < 0 || v < best_val) {
            best = s;
            best_val = v;
          }
        }
        take(&pool.members[pool.segments[best].begin], need);
        break;
      }
      const Segment& seg = pool.segments[info.whole_order[next_whole++]];
      take(&pool.members[seg.begin], seg.end - seg.begin);
      need -= seg.end - seg.begin;
    }
    return true;
  }

  // sub = members of `pool` that are in `group`, same order.
  void restrict_pool(const Pool& pool, const Group& group, Pool& sub) {
    sub.members.clear();
    for (const Member& m : pool.members)
      if (test_bit(group.bits.data(), m.id)) sub.members.push_back(m);
    sub.by_queue.clear();
    for (const auto& e : pool.by_queue)
      if (test_bit(group.bits.data(), e.second)) sub.by_queue.push_back(e);
    sub.index(num_nodes_, n_);
  }

  // --- Algorithms 1-3 ------------------------------------------------------------------------------------
  // Fills levels_[depth].best with the chunks of the remaining `tokens` and returns the plan's TTFT.
  // levels_[depth].pool holds queue times relative to absolute time t0; the SP sizes are sizes_[lo..hi].
  //
  // The pairs of Algorithm 1 are explored best-first (by a lower bound of their TTFT) with branch and bound;
  // ties go to the earlier pair in the paper's order (s_current, then s_next, ascending), after the single-chunk
  // plan. The result is exactly the sequential algorithm's: the earliest plan with the smallest TTFT. `cutoff`:
  // the caller only needs the result if its TTFT is <= cutoff; otherwise any value > cutoff may be returned.
  double schedule(int depth, long long tokens, long long context, const Group& init, int lo, int hi, double t0,
                  double cutoff) {
    Level& lv = levels_[depth];
    // Algorithm 2: one chunk; SP grows only for a TTFT gain above the improvement rate.
    describe_init(lv.pool, init, lv.init_pool);
    double opt_ttft = std::numeric_limits<double>::infinity();
    int opt_idx = -1, opt_mode = 0;
    double opt_prefill = 0.0;
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
    double opt_queue = 0.0;
    get_group(lv.pool, lv.init_pool, sizes_[opt_idx], opt_queue, &lv.group);
    const double end_rel = opt_queue + opt_prefill;
    double best_ttft = t0 + end_rel;
    int best_rank = -1;  // the single-chunk plan comes first in the paper's order
    lv.best.clear();
    lv.best.push(tokens, context, lv.group, t0 + opt_queue, t0 + end_rel, opt_mode);
    if (!chunking_) return best_ttft;

    // Algorithm 1, step 1: (s_current, s_next) pairs inside the single-chunk group.
    int cdsp_hi = lo;
    while (cdsp_hi + 1 <= hi && sizes_[cdsp_hi + 1] <= lv.group.size) ++cdsp_hi;
    if (cdsp_hi == lo) return best_ttft;
    restrict_pool(lv.pool, lv.group, lv.sub);
    describe_init(lv.sub, init, lv.init_sub);
    lv.candidates.clear();
    if (static_cast<int>(lv.currents.size()) < cdsp_hi - lo + 1) lv.currents.resize(cdsp_hi - lo + 1);
    for (int kc = lo; kc <= cdsp_hi; ++kc) {
      Group& current = lv.currents[kc - lo];
      double queue_cur = 0.0;
      if (!get_group(lv.sub, lv.init_sub, sizes_[kc], queue_cur, &current)) continue;
      describe_init(lv.sub, current, lv.current_sub);
      for (int kn = kc + 1; kn <= cdsp_hi; ++kn) {
        double queue_next = 0.0;
        if (!get_group(lv.sub, lv.current_sub, sizes_[kn], queue_next, nullptr)) continue;
        // Algorithm 3: the chunk may run until the larger group frees up.
        const double budget = queue_next - queue_cur;
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
        c.key = c.child_t0 + lower_bound(kn, cdsp_hi, tokens - len, context + len, lv.sub.by_queue, c.chunk_end) *
                                 (1.0 - 1e-9);
        if (!beyond(c.key, std::min(cutoff, best_ttft))) lv.candidates.push_back(c);
      }
    }
    std::sort(lv.candidates.begin(), lv.candidates.end(), [](const Candidate& x, const Candidate& y) {
      return x.key != y.key ? x.key < y.key : x.rank < y.rank;
    });
    Level& child = levels_[depth + 1];
    for (const Candidate& c : lv.candidates) {
      const double bound = std::min(cutoff, best_ttft);
      if (beyond(c.key, bound)) break;  // sorted by key: no later pair can reach the bound either
      // Eq. 2: queue times re-based on the end of this chunk.
      child.pool.members.assign(lv.sub.members.begin(), lv.sub.members.end());
      for (Member& m : child.pool.members) m.q = std::max(0.0, m.q - c.chunk_end);
      child.pool.by_queue.assign(lv.sub.by_queue.begin(), lv.sub.by_queue.end());  // a monotone map keeps it sorted
      for (auto& [q, id] : child.pool.by_queue) q = std::max(0.0, q - c.chunk_end);
      child.pool.resort();
      child.pool.index(num_nodes_, n_);
      const Group& current = lv.currents[c.kc - lo];
      const double ttft =
          schedule(depth + 1, tokens - c.len, context + c.len, current, c.kn, cdsp_hi, c.child_t0, bound);
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

  // A plan whose TTFT is at least `key` (up to the margin folded into it) cannot reach `bound`.
  static bool beyond(double key, double bound) { return key > bound * (1.0 + 1e-12); }

  // Lower bound of the TTFT (relative to its start) of any plan of the remaining `tokens` with SP sizes
  // sizes_[lo..hi]: if its last chunk has s_f instances, every chunk has between sizes_[lo] and s_f, so the work
  // takes at least the lower envelope of Eq. 1 over those sizes (superadditive, so chunking cannot beat it), and
  // the last chunk starts no earlier than the s_f-th shortest re-based queue time. Same bound as
  // CdspPlanner._cannot_win in Python.
  double lower_bound(int lo, int hi, long long tokens, long long context,
                     const std::vector<std::pair<double, int>>& by_queue, double shift) const {
    const double rest = static_cast<double>(tokens);
    const double ctx = static_cast<double>(context);
    double lower = std::numeric_limits<double>::infinity();
    for (int f = lo; f <= hi; ++f) {
      const Envelope& e = envelope_[lo * sizes_.size() + f];
      const double work = e.a + e.b * rest + e.c * ctx * rest + e.m * rest * rest;
      const double last_start = std::max(0.0, by_queue[sizes_[f] - 1].first - shift) + min_a(f);
      lower = std::min(lower, std::max(work, last_start));
    }
    return lower;
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
    std::sort(pool.members.begin(), pool.members.end(), member_less);
    pool.index(num_nodes_, n_);
    pool.by_queue.resize(n_);
    for (int i = 0; i < n_; ++i) pool.by_queue[i] = {queue[i], i};
    std::sort(pool.by_queue.begin(), pool.by_queue.end());
    return schedule(0, length, 0, empty_, 0, static_cast<int>(sizes_.size()) - 1, 0.0,
                    std::numeric_limits<double>::infinity());
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
  std::vector<Level> levels_;
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
