// SchedulerCore::check_invariants: reference.py check_invariants (loads, pages owned once, waiting/running partition)
// plus the C++-only indexes (admission-order index, decode-budget list, multi-shard list, node and remote counters,
// block-table slots and the frames still to list per instance).
#include <set>
#include <tuple>
#include <unordered_set>

#include "scheduler.h"

namespace nanocp::sched {

void SchedulerCore::check_invariants() {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw InvariantError(what);
  };
  compact_running(true);
  for (size_t g = 0; g < running_.size(); ++g) sync(g);
  const int n = shape_.num_instances;
  const int64_t page = shape_.page_size;
  std::vector<int64_t> kv(n, 0), batch(n, 0), shards(n, 0), remote(n, 0), node(shape_.num_nodes, 0);
  std::vector<int64_t> used(n, 0), unlisted(n, 0);
  std::vector<std::vector<char>> slot_seen(n);
  for (int i = 0; i < n; ++i) slot_seen[i].assign(size_t(slots_[i].high()), 0);
  std::vector<std::vector<char>> frame_seen(n, std::vector<char>(shape_.frames_per_instance, 0));
  int64_t multi_shard = 0;
  require(rec_.size() == running_.size() && rec_due_.size() == running_.size(), "batch records out of date");
  std::set<std::tuple<int32_t, int64_t, int64_t>> budget_keys;
  for (const auto& bucket : budget_due_.buckets)
    for (const Calendar::Item& e : bucket) budget_keys.insert({e.who.slot, e.who.uid, e.at});
  for (size_t g = 0; g < running_.size(); ++g) {
    const int32_t slot = running_[g];
    const Request& r = reqs_[slot];
    require(r.status == kRunning, "batch holds a request that is not running");
    require(r.pos == int32_t(g), "batch position out of date");
    require(g == 0 || reqs_[running_[g - 1]].admit_seq < r.admit_seq, "batch is not in admission order");
    require(r.nshards >= 1 && r.moe_shard >= 0 && r.moe_shard < r.nshards && r.shard(r.moe_shard).instance == r.moe,
            "MoE instance must hold a shard");
    batch[r.moe] += 1;
    node[r.moe / shape_.instances_per_node] += 1;
    remote[r.moe] += r.nshards - 1;
    multi_shard += r.nshards >= 2;
    for (int32_t k = 0; k < r.nshards; ++k) {
      const Shard& s = r.shard(k);
      for (int32_t j = 0; j < k; ++j) require(r.shard(j).instance != s.instance, "two shards on one instance");
      require(s.tokens > 0 && int64_t(s.frames.size()) == (s.tokens + page - 1) / page, "shard pages != tokens");
      require(s.emitted >= 0 && s.emitted <= s.frames.size(), "a shard listed more frames than it holds");
      unlisted[s.instance] += s.frames.size() - s.emitted;
      require(s.slot >= 0 && s.slot < slots_[s.instance].high() && !slot_seen[s.instance][s.slot],
              "block-table slot out of range or held twice");
      slot_seen[s.instance][s.slot] = 1;
      kv[s.instance] += s.tokens;
      shards[s.instance] += 1;
      for (int32_t f : s.frames) {
        require(f >= 0 && f < shape_.frames_per_instance, "frame id out of range");
        require(!frame_seen[s.instance][f], "page (" + std::to_string(s.instance) + ", " + std::to_string(f) +
                                                ") owned twice");
        frame_seen[s.instance][f] = 1;
        used[s.instance] += 1;
      }
    }
    require(r.due_at == r.max_new_tokens - 1 - r.decode_base, "decode budget out of date");
    BatchRec want;
    fill_rec(want, r);
    const BatchRec& got = rec_[g];
    require(got.tokens_off() == want.tokens_off() && got.blocks == want.blocks && rec_due_[g] == r.due_at &&
                got.moe == want.moe && rec_window(got) == rec_window(want) &&
                (!got.lower_fast() || want.lower_fast()) && (!got.lower_fast() || got.slot() == want.slot()) &&
                got.shard_row[1] == -1 && got.moe_row[0] == 0 && got.moe_row[2] == 0 &&
                got.moe_row[1] == int32_t(uint32_t(got.shard_row[2]) - uint32_t(got.window())),
            "batch record out of date");
    require(r.window >= 1 && r.window <= num_steps_, "window outside [1, num_steps]");
    // due_ must name every request that is out of decode budget at the next step
    if (decode_steps(r) >= r.max_new_tokens - 1) {
      bool listed = false;
      for (const Ref& e : due_) listed |= e.slot == slot && e.uid == r.uid;
      require(listed, "a request out of decode budget is missing from the finish list");
    }
    if (calendar_) {  // the growth calendar names the request's page-full clock and its decode budget
      const int64_t clock = full_at(got);
      require(clock >= growth_clock_ && clock - growth_clock_ < page, "page-full clock outside the next page");
      bool paged = false, budgeted = false;
      for (const Calendar::Item& e : page_due_.bucket_of(clock))
        paged |= e.who.slot == slot && e.who.uid == r.uid && e.at == clock && locate(e.who) == int64_t(g);
      budgeted = budget_keys.count({slot, r.uid, r.due_at}) > 0;
      require(paged, "growth calendar misses a running request's page-full clock");
      require(budgeted || decode_steps(r) >= r.max_new_tokens - 1, "growth calendar misses a decode budget");
    }
  }
  require(kv == kv_tokens_ && batch == moe_batch_ && shards == num_shards_, "per-instance load counters out of date");
  require(remote == remote_out_ && node == node_batch_, "remote-shard / node counters out of date");
  require(unlisted == pending_updates_, "frames still to list out of date");
  for (int i = 0; i < n; ++i) {
    for (int32_t slot : slots_[i].free_list()) {
      require(slot >= 0 && slot < slots_[i].high() && !slot_seen[i][slot], "a free slot is also held or listed twice");
      slot_seen[i][slot] = 1;
    }
    for (char seen : slot_seen[i]) require(seen, "a block-table slot is neither held nor free");
  }
  for (int i = 0; i < n; ++i) {
    require(used[i] + pages_.free_frames(i) == shape_.frames_per_instance, "used + free != frames");
    for (int32_t f : pages_.free_stack(i)) {
      require(f >= 0 && f < shape_.frames_per_instance && !frame_seen[i][f], "a free frame is also owned or listed twice");
      frame_seen[i][f] = 1;
    }
  }
  // waiting and running partition the live requests
  int64_t live_waiting = 0, live = 0;
  std::unordered_set<int32_t> queued;
  for (const Ref& e : waiting_) {
    const Request& r = reqs_[e.slot];
    if (r.uid != e.uid || r.status != kWaiting) continue;
    require(queued.insert(e.slot).second, "request queued twice");
    require(r.nshards == 0 && r.moe == -1, "waiting request holds KV");
    ++live_waiting;
  }
  for (size_t slot = 0; slot < reqs_.size(); ++slot) {
    const Request& r = reqs_[slot];
    if (r.status == kFree) continue;
    ++live;
    require(slot_of_handle_.find(r.handle) == int32_t(slot), "handle map names another slot");
  }
  require(live_waiting == num_waiting_, "num_waiting out of date");
  require(live == int64_t(running_.size()) + num_waiting_, "waiting and running do not cover the requests");
  require(int64_t(slot_of_handle_.size()) == live, "handle map out of date");
  // multi_: exactly the running multi-shard requests, in batch order, each entry matching its request
  require(int64_t(multi_.size()) == multi_shard, "multi-shard list out of date");
  for (size_t k = 0; k < multi_.size(); ++k) {
    const MultiRec& e = multi_[k];
    const Request& r = reqs_[e.slot];
    require(r.status == kRunning && r.admit_seq == e.admit_seq && r.nshards >= 2, "multi-shard list out of date");
    require(k == 0 || multi_[k - 1].admit_seq < e.admit_seq, "multi-shard list is not in batch order");
    MultiRec want{};
    refresh_multi(r, want);
    bool same = e.nshards == want.nshards && e.moe == want.moe && e.moe_shard == want.moe_shard &&
                e.other_tokens == want.other_tokens;
    for (int32_t j = 0; j < std::min(r.nshards, kMultiInline); ++j) {
      const MultiShard &a = e.shards[j], &b = want.shards[j];
      same &= a.instance == b.instance;
      // the tail's tokens and frames are the batch record's; slots are final once lowering may read the entry
      if (j != r.moe_shard) same &= a.tokens == b.tokens && a.frames == b.frames;
      if (rec_[size_t(r.pos)].lower_fast() == kLowerMulti) same &= a.slot == b.slot;
    }
    require(same, "multi-shard entry out of date");
  }
}

}  // namespace nanocp::sched
