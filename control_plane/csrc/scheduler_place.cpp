// Placement policies of SchedulerCore (reference.py _place and its helpers): each fills split_ with
// (instance, tokens) in split order, the window's new tokens included on the MoE instance, and says whether
// CanAllocate holds.
#include <algorithm>

#include "scheduler.h"

namespace nanocp::sched {
namespace {

// waterfill.py waterfill: fill_[j] for loads_[j], j < k, minimising the peak; leftovers go one each to the filled
// participants in participant order.
void waterfill(const std::vector<int64_t>& loads, int64_t total, std::vector<int32_t>& order,
                      std::vector<int64_t>& x) {
  const int k = int(loads.size());
  order.resize(k);
  for (int j = 0; j < k; ++j) order[j] = j;
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return std::make_pair(loads[a], a) < std::make_pair(loads[b], b); });
  int64_t filled_sum = 0;
  int m = 0;
  while (true) {
    filled_sum += loads[order[m]];
    m += 1;
    if (m == k || m * loads[order[m]] - filled_sum >= total) break;
  }
  const int64_t level = (total + filled_sum) / m;
  int64_t remainder = (total + filled_sum) % m;
  x.assign(k, -1);
  for (int j = 0; j < m; ++j) x[order[j]] = 0;  // mark the filled participants
  for (int j = 0; j < k; ++j) {
    if (x[j] < 0) {
      x[j] = 0;
      continue;
    }
    x[j] = level - loads[j];
    if (remainder > 0) {
      x[j] += 1;
      remainder -= 1;
    }
  }
}

}  // namespace

int64_t SchedulerCore::cp_lookup(int64_t length) const {  // cp_buckets.py lookup
  for (size_t k = 0; k < cp_max_lens_.size(); ++k)
    if (length <= cp_max_lens_[k]) return cp_cps_[k];
  return cp_cps_.back();
}

bool SchedulerCore::can_allocate(int moe) const {  // reference.py _can_allocate over split_
  if (!batch_open(moe)) return false;
  for (const auto& [i, n] : split_)
    if (ceil_div(n, shape_.page_size) > pages_.free_frames(i)) return false;
  return true;
}

bool SchedulerCore::place(int64_t context, int64_t window, int& moe) {  // reference.py _place
  split_.clear();
  if (policy_ == kNanoCP) return place_nanocp(context, window, moe);
  if (policy_ == kUniformCP) return place_uniform(context, window, moe);
  if (policy_ == kMedha) return place_medha(context, window, moe);
  if (policy_ == kCsps) return place_csps(context, window, moe);
  return place_single(context, window, moe);
}

bool SchedulerCore::place_single(int64_t context, int64_t window, int& moe) {
  const int n = shape_.num_instances;
  int target = 0;
  if (policy_ == kLeastBatch) {  // batch only (vLLM DP balancing)
    for (int i = 1; i < n; ++i)
      if (moe_batch_[i] < moe_batch_[target]) target = i;
  } else if (policy_ == kLeastCache) {  // KV only
    for (int i = 1; i < n; ++i)
      if (kv_tokens_[i] < kv_tokens_[target]) target = i;
  } else {
    target = int(rr_cursor_);
  }
  split_.emplace_back(target, context + window);
  if (!can_allocate(target)) return false;
  if (policy_ == kRoundRobin) rr_cursor_ = (rr_cursor_ + 1) % n;
  moe = target;
  return true;
}

// reference.py _place_nanocp: node with the fewest owned requests first; MoE = fewest MoE requests on the node;
// the other cp-1 participants = least KV; tokens by WaterFill; the first node where CanAllocate holds. The bucket's
// degree is raised to the least degree whose even split fits an instance.
bool SchedulerCore::place_nanocp(int64_t context, int64_t window, int& moe) {
  const int ipn = shape_.instances_per_node;
  const int64_t fit = room_ > 0 ? ceil_div(context, room_) : ipn;  // room_ == 0 admits nothing (max_context 0)
  const int64_t cp = std::min<int64_t>(std::max(cp_lookup(context), fit), ipn);
  for (int d = 0; d < shape_.num_nodes; ++d) node_order_[d] = d;
  std::sort(node_order_.begin(), node_order_.end(), [&](int32_t a, int32_t b) {
    return std::make_pair(node_batch_[a], a) < std::make_pair(node_batch_[b], b);
  });
  for (int32_t node : node_order_) {
    const int first = node * ipn;
    int m = first;
    for (int i = first + 1; i < first + ipn; ++i)
      if (std::make_pair(moe_batch_[i], kv_tokens_[i]) < std::make_pair(moe_batch_[m], kv_tokens_[m])) m = i;
    if (cp == 1) {  // the MoE instance alone: WaterFill over one participant gives it the whole context
      split_.clear();
      split_.emplace_back(m, context + window);
      if (can_allocate(m)) {
        moe = m;
        return true;
      }
      continue;
    }
    members_.clear();
    for (int i = first; i < first + ipn; ++i)
      if (i != m) members_.push_back(i);
    const size_t others = size_t(cp - 1);
    auto by_kv = [&](int32_t a, int32_t b) { return std::make_pair(kv_tokens_[a], a) < std::make_pair(kv_tokens_[b], b); };
    std::partial_sort(members_.begin(), members_.begin() + others, members_.end(), by_kv);
    members_.resize(others);
    members_.insert(members_.begin(), m);  // participants = [moe, *others]
    loads_.resize(members_.size());
    for (size_t j = 0; j < members_.size(); ++j) loads_[j] = kv_tokens_[members_[j]];
    waterfill(loads_, context, order_, fill_);
    split_.clear();
    for (size_t j = 0; j < members_.size(); ++j)
      if (fill_[j] > 0 || j == 0) split_.emplace_back(members_[j], fill_[j] + (j == 0 ? window : 0));
    if (can_allocate(m)) {
      moe = m;
      return true;
    }
  }
  return false;
}

// reference.py _place_uniform: the group of k with the fewest MoE requests (then KV); an even split.
bool SchedulerCore::place_uniform(int64_t context, int64_t window, int& moe) {
  const int64_t k = policy_arg_;
  const int groups = int(shape_.num_instances / k);
  int best = 0;
  int64_t best_batch = 0, best_kv = 0;
  for (int g = 0; g < groups; ++g) {
    int64_t batch = 0, kv = 0;
    for (int64_t i = g * k; i < (g + 1) * k; ++i) {
      batch += moe_batch_[i];
      kv += kv_tokens_[i];
    }
    if (g == 0 || std::make_pair(batch, kv) < std::make_pair(best_batch, best_kv)) {
      best = g;
      best_batch = batch;
      best_kv = kv;
    }
  }
  const int first = int(best * k);
  int m = first;
  for (int i = first + 1; i < first + k; ++i)
    if (std::make_pair(moe_batch_[i], kv_tokens_[i]) < std::make_pair(moe_batch_[m], kv_tokens_[m])) m = i;
  const int64_t base = context / k, extra = context % k;
  for (int j = 0; j < k; ++j) {
    const int64_t t = base + (j < extra ? 1 : 0) + (first + j == m ? window : 0);
    if (t > 0) split_.emplace_back(first + j, t);
  }
  if (!can_allocate(m)) return false;
  moe = m;
  return true;
}

// reference.py _place_medha: groups of N tokens on the least-KV instances; all full but the last, which takes the
// rest, the window's new tokens and the MoE binding.
bool SchedulerCore::place_medha(int64_t context, int64_t window, int& moe) {
  const int64_t n_groups = context / policy_arg_ + 1;
  if (n_groups > shape_.num_instances) return false;
  members_.resize(shape_.num_instances);
  for (int i = 0; i < shape_.num_instances; ++i) members_[i] = i;
  auto by_kv = [&](int32_t a, int32_t b) { return std::make_pair(kv_tokens_[a], a) < std::make_pair(kv_tokens_[b], b); };
  std::partial_sort(members_.begin(), members_.begin() + n_groups, members_.end(), by_kv);
  for (int64_t j = 0; j + 1 < n_groups; ++j) split_.emplace_back(members_[j], policy_arg_);
  moe = members_[n_groups - 1];
  split_.emplace_back(moe, context - policy_arg_ * (n_groups - 1) + window);
  return can_allocate(moe);
}

// reference.py _place_csps: up to S tokens (and what one instance holds): whole, on the instance with the fewest
// running requests; longer: ceil(L/S) (at least what fits) near-equal partitions on the least-KV instances of the
// least-KV node, MoE on the last one.
bool SchedulerCore::place_csps(int64_t context, int64_t window, int& moe) {
  if (context <= std::min(policy_arg_, room_)) {
    int target = 0;
    for (int i = 1; i < shape_.num_instances; ++i)
      if (std::make_pair(moe_batch_[i], kv_tokens_[i]) < std::make_pair(moe_batch_[target], kv_tokens_[target]))
        target = i;
    split_.emplace_back(target, context + window);
    moe = target;
    return can_allocate(target);
  }
  const int ipn = shape_.instances_per_node;
  const int64_t fit = room_ > 0 ? ceil_div(context, room_) : ipn;
  const int64_t parts = std::min<int64_t>(std::max(ceil_div(context, policy_arg_), fit), ipn);
  int node = 0;
  int64_t node_kv = 0;
  for (int d = 0; d < shape_.num_nodes; ++d) {
    int64_t kv = 0;
    for (int i = d * ipn; i < (d + 1) * ipn; ++i) kv += kv_tokens_[i];
    if (d == 0 || kv < node_kv) {
      node = d;
      node_kv = kv;
    }
  }
  members_.resize(ipn);
  for (int j = 0; j < ipn; ++j) members_[j] = node * ipn + j;
  auto by_kv = [&](int32_t a, int32_t b) { return std::make_pair(kv_tokens_[a], a) < std::make_pair(kv_tokens_[b], b); };
  std::partial_sort(members_.begin(), members_.begin() + parts, members_.end(), by_kv);
  const int64_t base = context / parts, extra = context % parts;
  moe = members_[parts - 1];
  for (int64_t j = 0; j < parts; ++j)
    split_.emplace_back(members_[j], base + (j < extra ? 1 : 0) + (j == parts - 1 ? window : 0));
  return can_allocate(moe);
}

}  // namespace nanocp::sched
