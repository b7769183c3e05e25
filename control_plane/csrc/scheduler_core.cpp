// SchedulerCore: requests in and out, one decode iteration (finish, rebalance, grow, admit), placement policies.
// Every decision mirrors control_plane/reference.py; comments name the reference function each part ports.
#include <algorithm>
#include <chrono>
#include <climits>

#include "scheduler.h"

namespace nanocp::sched {
namespace {

const char* const kPolicyNames[] = {"nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp", "medha", "csps"};
constexpr int kNumPolicies = 7;
constexpr int64_t kCspsDefaultPartition = 65536;  // CSPS's partition length without TP

std::string to_string_i128(__int128 v) {
  if (v == 0) return "0";
  const bool negative = v < 0;
  unsigned __int128 u = negative ? -(unsigned __int128)v : (unsigned __int128)v;
  std::string digits;
  while (u) {
    digits.push_back(char('0' + int(u % 10)));
    u /= 10;
  }
  if (negative) digits.push_back('-');
  return std::string(digits.rbegin(), digits.rend());
}

std::string tuple_repr(const std::vector<int64_t>& v) {  // Python's repr of a tuple of ints
  std::string s = "(";
  for (size_t k = 0; k < v.size(); ++k) s += (k ? ", " : "") + std::to_string(v[k]);
  return s + (v.size() == 1 ? ",)" : ")");
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// reference.py parse_policy; policy_repr is Python's repr(policy) for the messages. Returns the policy, its
// argument (INT64_MAX if it has more than 18 digits) and the argument as written without leading zeros.
struct ParsedPolicy {
  Policy policy;
  int64_t arg;
  std::string arg_text;
};

ParsedPolicy parse_policy(const std::string& policy, const std::string& policy_repr) {
  const size_t colon = policy.find(':');
  const std::string name = policy.substr(0, colon);
  const std::string arg = colon == std::string::npos ? "" : policy.substr(colon + 1);
  int found = -1;
  for (int k = 0; k < kNumPolicies; ++k)
    if (name == kPolicyNames[k]) found = k;
  if (found < 0)
    throw SchedulerError("unknown policy " + policy_repr +
                         "; choose one of nanocp, least-batch, least-cache, round-robin, uniform-cp:K, medha:N, "
                         "csps[:S]");
  if (found == kUniformCP || found == kMedha || (found == kCsps && !arg.empty())) {
    const bool digits = !arg.empty() && std::all_of(arg.begin(), arg.end(), [](char c) { return c >= '0' && c <= '9'; });
    const size_t first = digits ? arg.find_first_not_of('0') : std::string::npos;
    if (!digits || first == std::string::npos) {
      const char* example = found == kUniformCP ? "uniform-cp:4" : found == kMedha ? "medha:65536" : "csps:65536";
      throw SchedulerError("policy " + policy_repr + " needs a positive integer argument, e.g. " + example);
    }
    const std::string significant = arg.substr(first);
    return {Policy(found), significant.size() > 18 ? INT64_MAX : std::stoll(significant), significant};
  }
  if (!arg.empty())
    throw SchedulerError("policy '" + name + "' takes no argument, got " + policy_repr);
  const int64_t value = found == kCsps ? kCspsDefaultPartition : 0;
  return {Policy(found), value, std::to_string(value)};
}

}  // namespace

SchedulerCore::SchedulerCore(int64_t num_nodes, int64_t instances_per_node, int64_t kv_capacity_tokens,
                             int64_t page_size, const std::string& policy, const std::string& policy_repr,
                             const std::vector<int64_t>& cp_max_lens, const std::vector<int64_t>& cp_cps,
                             int64_t max_batch_per_instance)
    : pages_(0, 0) {
  // spec.py ClusterSpec.__post_init__
  const std::pair<const char*, int64_t> fields[] = {{"num_nodes", num_nodes},
                                                    {"instances_per_node", instances_per_node},
                                                    {"kv_capacity_tokens", kv_capacity_tokens},
                                                    {"page_size", page_size}};
  for (const auto& [name, value] : fields)
    if (value <= 0)
      throw SchedulerError(std::string("ClusterSpec.") + name + " must be a positive int, got " + std::to_string(value));
  if (kv_capacity_tokens < page_size)
    throw SchedulerError("ClusterSpec.kv_capacity_tokens (" + std::to_string(kv_capacity_tokens) +
                         ") is smaller than one page (" + std::to_string(page_size) + " tokens)");
  const __int128 instances = (__int128)num_nodes * instances_per_node;
  const int64_t frames = kv_capacity_tokens / page_size;
  if (instances > (1 << 20) || (__int128)frames * instances >= ((__int128)1 << 31))
    throw SchedulerError("ClusterSpec is too large: page ids must fit in int32");
  if ((__int128)frames * page_size * instances >= ((__int128)1 << 62))
    throw SchedulerError("ClusterSpec is too large: the cluster's KV tokens must fit in 62 bits");
  shape_ = {int(num_nodes), int(instances_per_node), int(instances), page_size, int32_t(frames)};

  // reference.py ReferenceCore.__init__
  const ParsedPolicy parsed = parse_policy(policy, policy_repr);
  policy_ = parsed.policy;
  policy_arg_ = parsed.arg;
  if (policy_ == kUniformCP && instances_per_node % policy_arg_ != 0)
    throw SchedulerError("uniform-cp:" + parsed.arg_text + " needs a group size dividing instances_per_node (" +
                         std::to_string(instances_per_node) + ")");
  room_ = int64_t(frames) * page_size - 1;  // tokens an instance can take besides one new token
  if (policy_ == kMedha && policy_arg_ > room_)
    throw SchedulerError("medha:" + parsed.arg_text + ": a KV group must fit one instance (" + std::to_string(room_) +
                         " tokens plus the new one)");
  if (max_batch_per_instance < 0)
    throw SchedulerError("max_batch_per_instance must be >= 0 (0 = unbounded), got " +
                         std::to_string(max_batch_per_instance));
  // cp_buckets.py CPBucketTable.__post_init__
  if (cp_max_lens.empty() || cp_max_lens.size() != cp_cps.size())
    throw SchedulerError("CPBucketTable needs as many max_lens as cps, and at least one bucket");
  for (size_t k = 1; k < cp_max_lens.size(); ++k)
    if (cp_max_lens[k] <= cp_max_lens[k - 1])
      throw SchedulerError("CPBucketTable.max_lens must be strictly increasing: " + tuple_repr(cp_max_lens));
  for (int64_t c : cp_cps)
    if (c < 1) throw SchedulerError("CPBucketTable.cps must be >= 1: " + tuple_repr(cp_cps));
  cp_max_lens_ = cp_max_lens;
  cp_cps_ = cp_cps;
  max_batch_ = max_batch_per_instance;

  // reference.py max_context: one slot per instance stays free for the new token
  if (policy_ == kNanoCP || policy_ == kCsps)
    max_context_ = instances_per_node * room_;
  else if (policy_ == kUniformCP)
    max_context_ = policy_arg_ * room_;
  else if (policy_ == kMedha)
    max_context_ = instances * policy_arg_ - 1;
  else
    max_context_ = room_;
  group_tokens_ = policy_ == kMedha ? policy_arg_ : INT64_MAX;

  const int n = shape_.num_instances;
  pages_ = PageTable(n, shape_.frames_per_instance);
  kv_tokens_.assign(n, 0);
  moe_batch_.assign(n, 0);
  num_shards_.assign(n, 0);
  remote_out_.assign(n, 0);
  node_batch_.assign(shape_.num_nodes, 0);
  node_order_.resize(shape_.num_nodes);
  multi_count_.assign(n + 2, 0);
}

// ------------------------------------------------------------------ requests in and out

int32_t SchedulerCore::slot_of(int64_t handle) const {
  auto it = slot_of_handle_.find(handle);
  return it == slot_of_handle_.end() ? -1 : it->second;
}

const Request& SchedulerCore::request(int64_t handle) const {
  const int32_t slot = slot_of(handle);
  if (slot < 0) throw UnknownHandle{handle};
  return reqs_[slot];
}

int32_t SchedulerCore::new_slot() {
  if (!free_slots_.empty()) {
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  reqs_.emplace_back();
  return int32_t(reqs_.size() - 1);
}

void SchedulerCore::delete_request(int32_t slot) {
  Request& r = reqs_[slot];
  slot_of_handle_.erase(r.handle);
  r.status = kFree;
  r.uid = -1;
  free_slots_.push_back(slot);
}

void SchedulerCore::add_request(int64_t handle, int64_t prompt_len, int64_t max_new_tokens) {
  const std::string who = "request " + std::to_string(handle);
  if (slot_of(handle) >= 0) throw SchedulerError(who + " already exists");
  if (prompt_len < 1 || max_new_tokens < 1)
    throw SchedulerError(who + ": prompt_len and max_new_tokens must be >= 1");
  const __int128 longest = (__int128)prompt_len + max_new_tokens - 1;
  const int64_t cluster = int64_t(shape_.num_instances) * shape_.frames_per_instance * shape_.page_size;
  if (longest > cluster)
    throw SchedulerError(who + " needs " + to_string_i128(longest) + " tokens of KV, the whole cluster holds " +
                         std::to_string(cluster));
  if (prompt_len > max_context_)
    throw SchedulerError(who + ": prompt of " + std::to_string(prompt_len) +
                         " tokens can never be admitted under policy " + kPolicyNames[policy_] + " (at most " +
                         std::to_string(max_context_) + ")");
  const int32_t slot = new_slot();
  Request& r = reqs_[slot];
  r.handle = handle;
  r.prompt_len = prompt_len;
  r.max_new_tokens = max_new_tokens;
  r.decode_base = 0;
  r.status = kWaiting;
  r.admit_seq = -1;
  r.moe = r.moe_shard = -1;
  r.nshards = 0;
  r.preempted_at = -1;
  r.uid = uid_counter_++;
  slot_of_handle_.emplace(handle, slot);
  waiting_.push_back({slot, r.uid});
  ++num_waiting_;
  if (max_new_tokens == 1) ++waiting_single_token_;
}

void SchedulerCore::finish(int64_t handle) {
  const int32_t slot = slot_of(handle);
  if (slot < 0) throw SchedulerError("unknown request " + std::to_string(handle));
  finish_slot(slot);
}

// reference.py finish: running -> pages freed; waiting -> leaves the queue (its entry goes stale).
void SchedulerCore::finish_slot(int32_t slot) {
  Request& r = reqs_[slot];
  if (r.status == kRunning) {
    release(r);
    remove_running(slot);
  } else {
    --num_waiting_;
    if (r.max_new_tokens == 1) --waiting_single_token_;
  }
  finished_pending_.push_back(r.handle);
  delete_request(slot);
  // Keep the queue from filling with stale entries when requests are cancelled while they wait.
  if (int64_t(waiting_.size()) > 2 * num_waiting_ + 64) {
    size_t keep = 0;
    for (const Ref& e : waiting_)
      if (reqs_[e.slot].uid == e.uid) waiting_[keep++] = e;
    waiting_.resize(keep);
  }
}

// The batch is in admission order, so a request's position is found by binary search on admit_seq.
void SchedulerCore::remove_running(int32_t slot) {
  const int64_t seq = reqs_[slot].admit_seq;
  const size_t pos = size_t(std::lower_bound(running_seq_.begin(), running_seq_.end(), seq) - running_seq_.begin());
  if (pos + 1 == running_.size()) {
    running_.pop_back();
    running_seq_.pop_back();
  } else {
    running_[pos] = -1;
    ++running_dead_;
  }
}

void SchedulerCore::compact_running() {
  if (!running_dead_) return;
  size_t keep = 0;
  for (size_t k = 0; k < running_.size(); ++k) {
    if (running_[k] < 0) continue;
    running_[keep] = running_[k];
    running_seq_[keep++] = running_seq_[k];
  }
  running_.resize(keep);
  running_seq_.resize(keep);
  running_dead_ = 0;
}

std::vector<int64_t> SchedulerCore::batch_handles() {
  compact_running();
  std::vector<int64_t> out(running_.size());
  for (size_t g = 0; g < running_.size(); ++g) out[g] = reqs_[running_[g]].handle;
  return out;
}

// ------------------------------------------------------------------ one iteration

void SchedulerCore::step() {
  const auto t0 = std::chrono::steady_clock::now();
  ++iteration_;
  last_admitted_.clear();
  last_preempted_.clear();
  last_rejected_.clear();
  preempted_slots_.clear();
  finish_completed();
  last_finished_.swap(finished_pending_);
  finished_pending_.clear();
  compact_running();
  if (policy_ == kNanoCP) rebalance_moe();
  due_.clear();
  grow_all();
  admit_waiting();
  ++step_ends_;  // every request in the batch counts one decode iteration
  last_step_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

// reference.py _finish_completed: running requests out of decode budget (batch order), then waiting requests that
// need no decode iteration (queue order).
void SchedulerCore::finish_completed() {
  for (const Ref& e : due_) {
    const Request& r = reqs_[e.slot];
    if (r.uid == e.uid && r.status == kRunning && decode_steps(r) >= r.max_new_tokens - 1) finish_slot(e.slot);
  }
  due_.clear();
  if (!waiting_single_token_) return;
  single_token_.clear();
  for (const Ref& e : waiting_) {
    const Request& r = reqs_[e.slot];
    if (r.uid == e.uid && r.status == kWaiting && r.max_new_tokens == 1) single_token_.push_back(e.slot);
  }
  for (int32_t slot : single_token_) finish_slot(slot);
}

// reference.py _rebalance_moe: multi-shard requests, fewest shards first (stable in batch order), each to the
// instance of its KV binding with the fewest MoE requests (ties: stay, then lowest id).
void SchedulerCore::rebalance_moe() {
  size_t keep = 0;
  int32_t widest = 0;
  for (const MultiRef& e : multi_) {
    const Request& r = reqs_[e.slot];
    if (r.status != kRunning || r.admit_seq != e.admit_seq) continue;
    multi_[keep++] = e;
    widest = std::max(widest, r.nshards);
  }
  multi_.resize(keep);
  if (multi_.empty()) return;
  // stable counting sort by shard count
  std::fill(multi_count_.begin(), multi_count_.begin() + widest + 2, 0);
  for (const MultiRef& e : multi_) ++multi_count_[reqs_[e.slot].nshards + 1];
  for (int32_t c = 1; c <= widest + 1; ++c) multi_count_[c] += multi_count_[c - 1];
  multi_sorted_.resize(multi_.size());
  for (const MultiRef& e : multi_) multi_sorted_[multi_count_[reqs_[e.slot].nshards]++] = e;

  for (const MultiRef& e : multi_sorted_) {
    Request& r = reqs_[e.slot];
    const int old = r.moe;
    moe_batch_[old] -= 1;
    int best = old, best_shard = r.moe_shard;
    for (int32_t k = 0; k < r.nshards; ++k) {
      const int i = r.shard(k).instance;
      if (std::make_tuple(moe_batch_[i], i != old, i) < std::make_tuple(moe_batch_[best], best != old, best)) {
        best = i;
        best_shard = k;
      }
    }
    moe_batch_[old] += 1;
    if (best != old) {
      unbind_moe(r);
      bind_moe(r, best);
    }
    r.moe_shard = best_shard;
  }
}

bool SchedulerCore::has_room(const Request& r, int instance) const {  // reference.py _has_room
  for (int32_t k = 0; k < r.nshards; ++k)
    if (r.shard(k).instance == instance && r.shard(k).has_room_in_tail(shape_.page_size)) return true;
  return pages_.free_frames(instance) > 0;
}

// reference.py _growth_target: the MoE instance, else the least-KV member of the binding, of the node, of the
// cluster that has room and an open batch; -1 if none. Medha: a full tail group moves to a fresh instance.
int SchedulerCore::growth_target(const Request& r) const {
  int best = -1;
  auto better = [&](int i) { return best < 0 || std::make_pair(kv_tokens_[i], i) < std::make_pair(kv_tokens_[best], best); };
  const int first = (r.moe / shape_.instances_per_node) * shape_.instances_per_node;
  if (r.shard(r.moe_shard).tokens >= group_tokens_) {
    // Medha: a full tail group opens a new instance (not yet in the binding), on the node first.
    auto fresh = [&](int i) {
      if (!better(i) || pages_.free_frames(i) <= 0 || !batch_open(i)) return;
      for (int32_t k = 0; k < r.nshards; ++k)
        if (r.shard(k).instance == i) return;
      best = i;
    };
    for (int i = first; i < first + shape_.instances_per_node; ++i) fresh(i);
    if (best >= 0) return best;
    for (int i = 0; i < shape_.num_instances; ++i) fresh(i);
    return best;
  }
  if (has_room(r, r.moe)) return r.moe;
  auto consider = [&](int i) {
    if (better(i) && has_room(r, i) && batch_open(i)) best = i;
  };
  for (int32_t k = 0; k < r.nshards; ++k) consider(r.shard(k).instance);
  if (best >= 0) return best;
  for (int i = first; i < first + shape_.instances_per_node; ++i) consider(i);
  if (best >= 0) return best;
  for (int i = 0; i < shape_.num_instances; ++i) consider(i);
  return best;
}

// Every running request gains one token on its MoE instance (reference.py step's growth loop + _grow). Requests
// out of decode budget after this iteration are noted for the next step's finish pass.
void SchedulerCore::grow_all() {
  const int64_t page = shape_.page_size;
  for (size_t k = 0; k < running_.size(); ++k) {  // preemption only pops from the back: size() is re-read
    prefetch_request(k);
    const int32_t slot = running_[k];
    Request& r = reqs_[slot];
    Shard& s = r.shard(r.moe_shard);
    if (s.tokens >= group_tokens_) {  // medha: the tail group is full
      if (!grow_slow(slot)) continue;
    } else if (s.has_room_in_tail(page)) {
      s.tokens += 1;
      kv_tokens_[r.moe] += 1;
    } else if (pages_.free_frames(r.moe) > 0) {
      add_tokens(s, 1);
    } else if (!grow_slow(slot)) {
      continue;  // preempted itself
    }
    if (step_ends_ >= r.due_at) due_.push_back({slot, r.uid});
  }
}

// reference.py _grow when the MoE instance is full: find another target, preempting the most recently admitted
// request until one exists; returns false if `slot` itself was preempted.
bool SchedulerCore::grow_slow(int32_t slot) {
  Request& r = reqs_[slot];
  int target;
  while ((target = growth_target(r)) < 0) {
    const int32_t victim = running_.back();  // the most recently admitted: growth leaves no holes in the batch
    preempt(victim);
    if (victim == slot) return false;
  }
  if (target != r.moe) {
    unbind_moe(r);
    bind_moe(r, target);
  }
  int32_t idx = -1;
  for (int32_t k = 0; k < r.nshards; ++k)
    if (r.shard(k).instance == target) idx = k;
  if (idx < 0) {
    add_shard(r, target);
    idx = r.nshards - 1;
  }
  r.moe_shard = idx;
  add_tokens(r.shard(idx), 1);
  return true;
}

void SchedulerCore::add_tokens(Shard& s, int64_t n) {  // reference.py _add_tokens
  const int64_t page = shape_.page_size;
  const int64_t need = ceil_div(s.tokens + n, page) - ceil_div(s.tokens, page);
  pages_.alloc(s.instance, need, s.frames);
  s.tokens += n;
  kv_tokens_[s.instance] += n;
}

// Append an empty shard on `instance` to the binding (reusing a retired Shard's capacity).
void SchedulerCore::add_shard(Request& r, int instance) {
  if (r.nshards > 0 && size_t(r.nshards) > r.spill.size()) r.spill.emplace_back();
  Shard& s = r.shard(r.nshards++);
  s.instance = instance;
  s.tokens = 0;
  num_shards_[instance] += 1;
  if (r.moe >= 0) remote_out_[r.moe] += 1;
  if (policy_ == kNanoCP && r.status == kRunning && r.nshards == 2) {
    const MultiRef e{r.admit_seq, int32_t(&r - reqs_.data())};
    auto pos = std::lower_bound(multi_.begin(), multi_.end(), e,
                                [](const MultiRef& a, const MultiRef& b) { return a.admit_seq < b.admit_seq; });
    multi_.insert(pos, e);
  }
}

void SchedulerCore::bind_moe(Request& r, int instance) {
  r.moe = instance;
  moe_batch_[instance] += 1;
  node_batch_[instance / shape_.instances_per_node] += 1;
  remote_out_[instance] += r.nshards - 1;
}

void SchedulerCore::unbind_moe(Request& r) {
  moe_batch_[r.moe] -= 1;
  node_batch_[r.moe / shape_.instances_per_node] -= 1;
  remote_out_[r.moe] -= r.nshards - 1;
  r.moe = -1;
}

void SchedulerCore::release(Request& r) {  // reference.py _release
  for (int32_t k = 0; k < r.nshards; ++k) {
    Shard& s = r.shard(k);
    pages_.free(s.instance, s.frames);
    kv_tokens_[s.instance] -= s.tokens;
    num_shards_[s.instance] -= 1;
  }
  unbind_moe(r);
  for (int32_t k = 0; k < r.nshards; ++k) r.shard(k).frames.clear();
  r.nshards = 0;
  r.moe_shard = -1;
}

void SchedulerCore::preempt(int32_t slot) {  // reference.py _preempt (the queue front is rebuilt at admission)
  Request& r = reqs_[slot];
  const int64_t steps = decode_steps(r);
  release(r);
  remove_running(slot);
  r.status = kWaiting;
  r.decode_base = steps;
  r.preempted_at = iteration_;
  ++num_waiting_;
  preempted_slots_.push_back(slot);
  last_preempted_.push_back(r.handle);
}

// ------------------------------------------------------------------ admission

// reference.py _admit_waiting: queue = this step's preempted requests (most recent first) + the old queue.
void SchedulerCore::admit_waiting() {
  still_waiting_.clear();
  for (size_t k = preempted_slots_.size(); k-- > 0;) {
    const int32_t slot = preempted_slots_[k];
    admit_one(slot, still_waiting_);
  }
  for (const Ref& e : waiting_) {
    const Request& r = reqs_[e.slot];
    if (r.uid == e.uid && r.status == kWaiting) admit_one(e.slot, still_waiting_);
  }
  waiting_.swap(still_waiting_);
}

bool SchedulerCore::admit_one(int32_t slot, std::vector<Ref>& still_waiting) {
  Request& r = reqs_[slot];
  const int64_t context = r.prompt_len + r.decode_base;
  if (context > max_context_) {
    last_rejected_.push_back(r.handle);
    --num_waiting_;
    delete_request(slot);
    return false;
  }
  int moe = -1;
  if (r.preempted_at == iteration_ || !place(context, moe)) {
    still_waiting.push_back({slot, r.uid});
    return false;
  }
  commit(slot, moe);
  return true;
}

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

bool SchedulerCore::place(int64_t context, int& moe) {  // reference.py _place
  split_.clear();
  if (policy_ == kNanoCP) return place_nanocp(context, moe);
  if (policy_ == kUniformCP) return place_uniform(context, moe);
  if (policy_ == kMedha) return place_medha(context, moe);
  if (policy_ == kCsps) return place_csps(context, moe);
  return place_single(context, moe);
}

bool SchedulerCore::place_single(int64_t context, int& moe) {
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
  split_.emplace_back(target, context + 1);
  if (!can_allocate(target)) return false;
  if (policy_ == kRoundRobin) rr_cursor_ = (rr_cursor_ + 1) % n;
  moe = target;
  return true;
}

// waterfill.py waterfill: fill_[j] for loads_[j], j < k, minimising the peak; leftovers go one each to the filled
// participants in participant order.
static void waterfill(const std::vector<int64_t>& loads, int64_t total, std::vector<int32_t>& order,
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

// reference.py _place_nanocp: node with the fewest owned requests first; MoE = fewest MoE requests on the node;
// the other cp-1 participants = least KV; tokens by WaterFill; the first node where CanAllocate holds. The bucket's
// degree is raised to the least degree whose even split fits an instance.
bool SchedulerCore::place_nanocp(int64_t context, int& moe) {
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
      if (fill_[j] > 0 || j == 0) split_.emplace_back(members_[j], fill_[j] + (j == 0 ? 1 : 0));
    if (can_allocate(m)) {
      moe = m;
      return true;
    }
  }
  return false;
}

// reference.py _place_uniform: the group of k with the fewest MoE requests (then KV); an even split.
bool SchedulerCore::place_uniform(int64_t context, int& moe) {
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
    const int64_t t = base + (j < extra ? 1 : 0) + (first + j == m ? 1 : 0);
    if (t > 0) split_.emplace_back(first + j, t);
  }
  if (!can_allocate(m)) return false;
  moe = m;
  return true;
}

// reference.py _place_medha: groups of N tokens on the least-KV instances; all full but the last, which takes the
// rest, the new token and the MoE binding.
bool SchedulerCore::place_medha(int64_t context, int& moe) {
  const int64_t n_groups = context / policy_arg_ + 1;
  if (n_groups > shape_.num_instances) return false;
  members_.resize(shape_.num_instances);
  for (int i = 0; i < shape_.num_instances; ++i) members_[i] = i;
  auto by_kv = [&](int32_t a, int32_t b) { return std::make_pair(kv_tokens_[a], a) < std::make_pair(kv_tokens_[b], b); };
  std::partial_sort(members_.begin(), members_.begin() + n_groups, members_.end(), by_kv);
  for (int64_t j = 0; j + 1 < n_groups; ++j) split_.emplace_back(members_[j], policy_arg_);
  moe = members_[n_groups - 1];
  split_.emplace_back(moe, context - policy_arg_ * (n_groups - 1) + 1);
  return can_allocate(moe);
}

// reference.py _place_csps: up to S tokens: whole, on the instance with the fewest running requests; longer: ceil(L/S)
// (at least what fits) near-equal partitions on the least-KV instances of the least-KV node, MoE on the last one.
bool SchedulerCore::place_csps(int64_t context, int& moe) {
  if (context <= policy_arg_) {
    int target = 0;
    for (int i = 1; i < shape_.num_instances; ++i)
      if (std::make_pair(moe_batch_[i], kv_tokens_[i]) < std::make_pair(moe_batch_[target], kv_tokens_[target]))
        target = i;
    split_.emplace_back(target, context + 1);
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
  for (int64_t j = 0; j < parts; ++j) split_.emplace_back(members_[j], base + (j < extra ? 1 : 0) + (j == parts - 1 ? 1 : 0));
  return can_allocate(moe);
}

// reference.py _commit: shards in order [moe, rest of the split in split order]; pages allocated in that order.
void SchedulerCore::commit(int32_t slot, int moe) {
  Request& r = reqs_[slot];
  const int64_t steps = r.decode_base;
  const bool recompute = steps > 0;
  r.status = kRunning;  // before add_shard, which enters multi-shard requests into multi_
  r.admit_seq = admit_counter_++;
  r.moe = -1;
  r.nshards = 0;
  for (int pass = 0; pass < 2; ++pass)
    for (const auto& [i, n] : split_) {
      if ((i == moe) != (pass == 0)) continue;
      add_shard(r, i);
      add_tokens(r.shard(r.nshards - 1), n);
    }
  bind_moe(r, moe);
  r.moe_shard = 0;
  r.decode_base = steps - step_ends_;
  r.due_at = r.max_new_tokens - 2 - r.decode_base;
  running_.push_back(slot);
  running_seq_.push_back(r.admit_seq);
  --num_waiting_;
  last_admitted_.emplace_back(r.handle, r.context_len() - 1, recompute);
  if (step_ends_ >= r.due_at) due_.push_back({slot, r.uid});
}

}  // namespace nanocp::sched
