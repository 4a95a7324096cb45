"""How many drafts each step verifies: a fixed k, or one chosen every step (adaptive depth).

No torch (Python, and numpy for a closed batch's drain): the engine reports what each step cost and what its
drafts achieved, and asks for the next step's k.

Adaptive (`--speculative_adaptive=true`, K = `--num_speculative_tokens`): a
step at depth k yields, per sequence, E[k] = 1 + sum_{j=1..k} p_1 p_2 ... p_j
tokens, where p_j is the chance that draft j is accepted given drafts
1..j-1 were. The policy estimates every p_j from decayed counts (each step
multiplies the old counts by `decay`, so recent steps weigh more, or by
`verify_decay` to the power of its verifies where that ages them less; steps
that verify no draft only down to `hold_weight`, below; a p_j with little
evidence leans on p_{j-1}'s estimate, since depths past the one in use are
only measured by probes) and the
step's cost c(k, b) per batch-size bucket b from the measured step times
(seeded by the engine's warm-up), and picks the k in 0..K with the most
tokens per second, E[k] / c(k, b). A machine whose speed changes (other work
on its cores) would make the depth in use look dearer than the others, last
measured when it was quieter, so every step's time is split into a bucket's
load factor, which moves fast and is shared by all k, and the k's own cost
at unit load, which moves slowly: c(k, b) = load(b) * unit(k, b). Only the
depth in use moves the load; a step at another depth (a probe) moves that
depth's unit cost, by `probe_cost_smoothing`. A k's score must beat the current one's
by `switch_margin` to replace it (noise in the timings would otherwise flip
k every step, and each rise pays for drafts the previous step did not make).

The counts span ~1 / (1 - decay) steps (10) or ~1 / (1 - verify_decay)
verifies (33), whichever is more: from batch 4 on the steps' window stands,
below it the verifies'. At batch 1 a window of 10 verifies is one sequence's
last 10 steps, and a few of them missing drafts 2 and 3 (a hard stretch of
text) put p_2 and p_3 at ~0.6: the policy fell from k = 3 to k = 1, where
drafts 2 and 3 get no evidence until their counts decay away, and held it
for 20-50 steps (bench preset, 128-token prompts one at a time: 0.95 of
fixed k = 3's tokens/s, k = 1 or 2 on 8-30% of the steps). With the verifies'
window it ran 0.97 (k < 3 on under 1% of the steps). A draft gone bad is still
seen within a few dozen steps, at batch 1 a few dozen milliseconds. The
verifies' window is for the drafts a step verifies: those past its depth get
no evidence, and aged by verifies they stood still. On the engine
benchmark's prompts one at a time, a hard stretch of 16 steps put p_2 at 0.47
(0.99 before it), the policy fell to k = 1, and p_2, unverified there, held
0.47 for ~170 steps, over the next few prompts, until its counts had decayed
below the prior's weight (mean k 2.2-2.4 where fixed k = 3 was best by 3%).
So a step's counts of the drafts past its depth age by the steps' window
(decay) where the verifies' is the longer: within ~40 steps they lean on the
estimate of the draft before them, and the policy goes back to k = 3 if that
one agrees (mean k 2.6-2.7, 0.955 -> 0.965-0.987 of fixed k = 3, two engines
each). From batch 4 on nothing changes.

Only a step that follows `cold_steps` (2) steps at the same depth is timed.
Each depth's step is code and data of its own (in graph mode, a compiled
package per k), and the first steps after one at another depth run cold: on
the bench preset at batch 4, a k = 0 step right after a k = 3 step took
0.85-0.93 ms against 0.65 ms after another k = 0 step, and in a later run of
six k = 3 steps then six k = 0 steps, the k = 0 steps took 1.56, 1.54, 1.36,
1.35, 1.36 and 1.26 ms (the k = 3 steps 4.48, 3.36, 3.48, 3.24, 3.22, 3.26).
Timed, those cold steps made the depths not in use (known only from probes
and the start-up's dummy steps) look dearer than they run, the cheapest the
most, and the policy speculated where k = 0 was faster. A closed batch's
first steps after sequences join it run cold too, after their prompts'
prefill (bench preset, batch 32, k = 0: the first decode step took 5.7 ms,
the fourth 4.6, from the seventh on 4.0-4.5 as the contexts grew); set
against them, the first batch's probes put k = 3 at 3.6 times k = 0's step
where it ran 4.5 times, and the policy ran k = 1 or 3 at batch 32, where
k = 0 was 19-30% faster. So the `settle_steps` (8) steps from the one at
which sequences join a closed batch are not timed, and no probe starts in
them.

Exploration: a policy at k = 0 that has seen no verify yet (a fresh engine:
its acceptance is only the prior's) probes the deepest k at once, untimed (those
are the engine's first steps, at up to twice their later cost; one step longer
where a prompt's first drafts wait, below, so that two steps verify real
drafts); and every
`probe_interval` steps (jittered, from `seed`, so runs repeat) the policy runs
another k, in turn, so that every depth keeps being measured: when the draft
turns bad the policy falls to k = 0, and the probes bring speculation back
once it agrees again. Probes cost: at batch 4, where k = 0 was best, an
adaptive engine that held it ran ~10% below fixed k = 0 with a probe of three
steps every ~128 (the steps at the higher k, the cold steps on both sides, the
fill of the draft keys left out). So the gap doubles after every probe that
changed nothing, up to `probe_backoff` (4) times `probe_interval`; a change of
depth, or a probe after which its depth scored within `probe_close` (10%) of
the depth in use, sets it back; and a probe of a depth dearer than the one in
use waits until its steps' extra cost is at most `probe_budget` (2%) of the time
since the last probe (closed batches of 16: a k = 1 step cost twice a k = 0
one, and with a close call every ~128 steps, its probes, fills and cold steps
held the policy at 0.91x k = 0; now 1.01x). A probe up from k = 0 also pays the draft's fill of
the keys the steps at k = 0 left out, every running sequence's prompt and tokens since (engine:
`unseen_positions`, times the draft pass's seconds a position), and that counts in its wait too:
with a draft gone bad at batch 1 (the drift benchmark, bench preset) a fill of ~190 positions at
~41 us each came with every probe, every ~300 steps of 0.45 ms (~6% by that count). (An adaptive
engine held at k = 0 there ran 0.77-0.87 of fixed k = 0 before this and 0.70 after: the fill is
not what costs it there, and what does is not found.) A wait is counted again every
quarter interval, at the batch size then. (A probe that moved its depth's cost by more
than 3% used to set it back; timings at batch 4 are noisy by more than that,
the gap seldom grew, and with a draft that never agreed an engine held at k =
0 ran 0.93x fixed k = 0.) A probe lasts `probe_steps` (6) steps: its first
ones run cold and are not timed, and at a higher k than the one before it
verifies filler for the drafts the earlier step did not make (engine:
`Sequence.num_real_drafts`; only real drafts are counted as evidence). Its
timed steps count as one (a closed batch's cheapest, an open batch's mean,
below): a step's time is its cost plus
whatever else held the core then, and one timed step a probe set a depth's
cost for hundreds of steps on the noise of one (served at concurrency 2,
probes put a k = 3 step at batch 2 at 2.8-3.5 ms against k = 2's 1.6, and the
policy held k = 2); the third step of a probe is also the coldest timed
(k = 0 after k = 3: 1.09x its cost, less from the fourth on). With 4 steps,
two of them timed, the cheapest still ran warm-up slow: closed batches of 4,
where fixed k = 1 was best and its steps took 1.26 ms with the host's time,
had the drain's table put k = 1 at 1.28-1.53 ms from its probes out of k =
2 and 3, and the policy held those (mean k 2.1-2.4, 0.931-0.944 of fixed
k = 1); with 6 steps, four timed, mean k 1.2-1.7 and 0.952-0.963 (medians
of 25 rounds, four runs; batch 1, 16 and 32 alike within 0.3%). It moves its
depth's cost `probe_cost_smoothing` (0.6) of the way: the costs of the
depths not in use drift with the depth in use's split of its own steps
into load and unit cost, which its steps alone cannot tell apart (served at
concurrency 32: k = 3 and 2 at batch 32 estimated at 3.1 and 2.1 times
k = 1's step where probes measured 1.26 and 1.44), and at 0.3, with each
probe's step bounded to outlier_ratio off the estimate, an error of 2.5
times took about nine probes, longer than a level of the benchmark, where
the policy held k = 1 and k = 3 was 7-9% faster. A probe
of a lower k only refreshes its cost and comes every second probe time (of
its bucket: a bucket's probe times alternate higher and lower on their own,
as a server's batch rising and falling every few hundred steps had its
higher probes at the small batches and its lower ones at 32, where k = 3
was never probed): the
load factor, moved by the depth in use alone, also carries that depth's own
drift (longer contexts, other prompts) to the depths below it, and at batch 4
the policy's k = 1 / k = 0 cost ratio fell to 1.6 where the steps measured
1.9, when a lower k was probed every fourth time.

A closed batch (`choose(..., draining=...)`): when no request waits and none
will arrive (the offline `LLM.generate`, once its last prompt is admitted),
the batch drains to its slowest sequence, and tokens per second of each step
is the wrong goal: drafts that speed up the sequences that would finish
early anyway leave a tail of steps in which the slow ones run with a few
sequences at nearly the cost of a full batch. So the policy then picks the k
whose estimated time to finish every running sequence is least: sequence i,
with R_i tokens left and its own acceptance (its verifies so far, shrunk
towards the policy's long-run estimate by `sequence_prior_weight` verifies:
the recent one, at the end of a batch, is its slowest sequences'), needs
n_i(k) = R_i / E_i[k] more steps, and the time is the sum over the steps to
come of c(k, b) at the number b of sequences still running. The choice is
revised every few steps (`drain_interval`, `drain_budget`), and at once when
sequences join the batch: a batch's tail of one sequence chose k = 3, and the
next batch of 16 prefilled at k = 3 (the draft's pass over its prompts, 6 ms
against 2 ms steps) before its first revision went back to k = 0. The
estimate runs between two model steps, its code and data cold: 0.4-0.5 ms
at 4 to 32 sequences on the bench preset (0.1-0.2 warm), so drain_budget,
not drain_interval, set how often it ran, and it took its 2% of the time
everywhere, also where one depth led by far (closed batches of 32: k = 0
ahead of k = 1 by 8-20% at every revision). So a choice stands
`drain_lead_hold` times longer for every switch margin its best depth leads
the next by (up to 32 steps), and is made anew when the batch falls to a
smaller bucket (three engines side by side, medians of 9-11 rounds:
adaptive over fixed k = 1, the best, 0.947 -> 0.959 at batch 4; over
k = 0 0.955 -> 0.968 at batch 32, 0.969 both ways at 16). Its budget was 2%
then; at batch 4, where every depth's speed was within 4% of the best
(fixed k = 1), an adaptive engine held at k = 1 spent 59 us a step in
`choose` (a 2.2-2.4 ms step), against 25 us at 0.5%, and the mid-batch
revisions the 2% bought did not show in the side by side (0.951 and 0.956
of fixed k = 1, 24 rounds), so the budget is 0.5%: between the revisions at
a batch's start and at each smaller bucket, at most one every 32 steps.

Sequences that have verified little are not all alike, though: prompts differ
in how well the draft does on them, so a batch that starts with every
sequence at the long-run estimate still ends with a tail of its slowest ones
(bench preset, batch 4, 64 tokens each: at k = 2 a quarter of the steps ran
with fewer than 4 sequences, at k = 0 none, which turned a tie in decoding
speed into a 10% loss). So the policy keeps, for the last `spread_window`
finished sequences, how far each one's expected tokens at each depth were
from the long-run estimate (`record_finished`; shrunk by `spread_prior_weight`
(1) verifies, not 4: a finished sequence's ratio at a depth it seldom ran
was mostly the prior's, and the spread too narrow), and in each of the
drain's draws (below) gives the running sequences, ranked by their own
estimates, the ratios of finished sequences drawn at random, sorted, each
in proportion to how little evidence of its own it has. (It gave them the
ratios' quantiles once, at (rank + 1/2) / n: closed batches of 4 at fixed
k = 3 had their last sequence finish at step 22.8 on average, the drain's
estimate at a batch's start 20.5, now 22.1; at k = 2 26.1, 25.5, now 26.1:
the slowest of n draws is further out than its quantile, and a step count,
R / E, is convex in E.) At k = 0 every ratio is 1 and the batch finishes
together, as it does.

Even sequences alike finish apart: a step at depth k gains 1 to k + 1 tokens
per sequence, so the steps a sequence needs for its R tokens vary, with
variance about R v / E^3 (v: the variance of one step's tokens, from the same
per-position acceptance). On the bench preset at batch 4 and k = 3, the
steps with fewer than 4 sequences left were 7.5 of a batch's 25, where the
spread of acceptance between prompts was narrow (finished sequences' E[3]
over the long-run estimate: 0.87 to 1.08 from q10 to q90), and the draws
below put the last of four sequences about 2 standard deviations (3 steps)
past the first. So the drain's time at each k
is the mean over `drain_samples` draws (a fixed set, so the choice repeats)
of each sequence's steps from that spread, sorted, each stretch between two
finishes costed at the number still running. At k = 0 every step gains
exactly one token: no spread.

Speculating costs more than its steps: at k > 0 the draft passes over every
prompt (its keys, and the first drafts from the last position), and after
steps at k = 0 the next step that drafts first fills the keys they left out.
On the bench preset a prompt's pass cost 41 us a position at batch 1 (3 ms
for a 64-token prompt, against a k = 3 step of 0.9 ms) and 12-17 us at batch
4: prefill ran 82 us a token at k = 3 against 65 at k = 0, and at batch 4,
where a k = 1 step's tokens per second tie k = 0's, that made every fixed k
lose to k = 0. The runner times these passes (`record_draft_pass`: seconds
per position, a ratio of decayed sums), the engine reports each finished
request's prompt and output lengths (`record_request`), and the policy
charges k > 0 the pass over the prompts to come, E[k] x (prompt positions per
output token) positions per sequence and step; a closed batch, whose prompts
are all in, is charged the positions of its sequences the draft has not
passed over yet (a prompt still to prefill, keys left out at k = 0).

In graph mode a greedy prompt's own first drafts wait for its first decode
step (ModelRunner._defers_first_drafts: drafting them beside the prompt cost
1.6-2.9 ms of eager draft steps at k = 1-3, bench preset), whose verify of
filler gains one token: a request of m decode tokens then takes 1 + (m - 1) / E
steps, and the policy counts E / (1 + (E - 1) / m) tokens a step at each depth
(`first_drafts_deferred`, m from the finished requests). A closed batch's
drain counts each sequence's such step apart: the engine tells, per
sequence, whether its next decode step verifies filler (its first drafts
deferred, or its drafts filler after a step at k = 0, so that a switch up
from k = 0 pays one step of one token per sequence), and its decode steps'
tokens left (a prompt's own step makes its first token at any k). Left out,
at the start of a closed batch of 4 at k = 3 the drain put its four
sequences' finishes at 16.9-19.7 steps where fixed k = 3's came at 17.1,
18.0, 19.5 and 22.9.

A step costs more than its model call: the host schedules it, updates the
sequences, builds the outputs, and the caller hands them on (a server's
engine thread delivers them and shares the interpreter with the thread that
streams them) before the next step starts. That time comes once per step
whatever the step's tokens, so it favours deeper steps, and it is not small:
served at concurrency 1 on the bench preset, k = 0 ran 971 tokens/s where its
model steps took 0.36 ms, about 0.5 ms of host time a step, and the policy
that left it out held k = 0 (0.87x k = 0's speed) where k = 3 ran 1.29x. The
engine times each decode step's host time, from its start to the next
step's start less the model's time (`record_overhead`, per bucket, smoothed
by `overhead_smoothing`; an interval after which the engine had nothing left
to do is not counted), and `cost` adds it to the model's. One estimate serves
every depth, kept up by the depth in use: kept per depth, the depths not in
use were known only from the few steps they ran, long ago or in a burst (a
server at concurrency 32 kept 5.5 ms for k = 0, from its first steps, against
1.4-1.9 ms measured step after step at k = 3; it ran mean k 2.7 at
concurrency 16, where k = 1 was best, and 2.9 at 32, where no depth beat
k = 0). Steps that also prefill are timed too (their host time around the
model call, prefill and decodes): at high concurrency they are most steps.

Which steps are timed: decode-only ones, and in a step that also prefills
(a server admits a request nearly every step at high concurrency) the
decodes' one-call part, which runs apart from the prompt chunks (graph mode)
and is timed as a decode step of its rows. With decode-only steps alone, a
server at concurrency 32 (32 requests of 64 tokens, at about 2 tokens a
step, admit about one request a step) timed few steps, its probes hardly
any, and its costs stayed near the start-up's, from dummy steps at 48 cached
tokens. A probe tells how its depth compares with the one in use: its
timed steps are set against the depth in use's recent steps of the
same batch size (a smoothed time per batch size, kept from the depth in
use's timed steps and dropped when the depth in use changes), and their
ratio, times the depth in use's cost, is the probed depth's. Noise only
slows a step, so a probe's cheapest step against a smoothed mean makes a probed
depth look cheaper than it runs: on a machine whose same work took 0.93-1.41
times its median, closed batches of 4 at k = 3 had a probe put k = 2 at
0.757 of k = 3's step where the two ran 0.785 of each other, and ran a
quarter of their batches at k = 2, each ~10% slower than at k = 3 (a
simulated probe of twice the depth in use's cost, noise 10%: put at 1.87
times it). In a closed batch, whose batch size steps down and whose last
steps are those just before the probe, it is set against the cheapest of
the depth in use's last steps of its size, as many as a probe times (the
same simulation: 2.0). In an open batch a batch size's last steps can lie
hundreds of steps apart, and with the cheapest of them a server at
concurrency 32 fell to k = 0 (mean k 0.2) where fixed k = 3 ran 1.3-1.4
times faster; the cheapest against the smoothed time, served at
concurrency 4 on a machine whose step times there spread 1.5 times, put
k = 1 at 0.55 of k = 2's step where they run 0.68 of each other, and the
policy fell to k = 1 (0.81 of the best fixed k). So there the mean of the
probe's timed steps, each bounded to outlier_ratio off its depth's
estimate as the depth in use's are, is set against the smoothed time (the
simulation: 2.0). It counts once the depth in
use has timed `reference_steps` (4) steps of that size: its first steps
after another depth's run cold past the two that are not timed (k = 0
after k = 3: 1.26, 1.15, 1.09x from the third on), and an engine at batch
16, just back at k = 0 from a batch of 4 at k = 2, timed k = 1 against
them at 1.7 times k = 0's step where it ran 2.0 times, and speculated
where k = 0 was 4% faster. Set against the bucket's cost
instead, a probe's step with one row prefilling and 3 decoding looked a
quarter cheaper than the 4-row steps of an open batch of 4, and the policy
ran k = 2 where k = 0 was about 10% faster; counted only at the batch size
the depth in use last ran, probes at concurrency 32 (26-32 rows decoding,
another size nearly every step) seldom counted, and the depths not in use
kept the start-up's costs times a load factor that k = 0's steps had set
(k = 1 and 2 estimated at 15.2 and 23.1 ms a step where they ran 11.1 and
15.6; k = 0 at 6.6 against 6.3).

The start-up's costs are a guess for served steps: its dummy steps see 48
cached tokens, and at concurrency 32 (contexts of 128-200 tokens) they put
k = 2 and 3 at 1.59 and 2.19 times k = 1's step where served steps ran 1.36
and 1.75 times. Probes of a dear depth come every few hundred steps there
(probe_budget; from k = 1, a higher depth every second probe time), each
moving its estimate by probe_cost_smoothing, and a server that came to
concurrency 32 at k = 1 held it where k = 2 and 3 ran 3-5% faster. So a
depth whose cost in a bucket is the start-up's alone is probed as soon as
the depth in use has run the batch size at hand (up to `early_probes`
times, for a probe whose timed step fell at another batch size), and its
first timed probe replaces the start-up's estimate: 4 steps per depth and
bucket, once in a server's life. Only for a depth within reach, though: one
whose score on the start-up's costs is at least 1 - `early_reach` (0.8) of
the depth in use's (the start-up's errors above were 15-25% of a step). The
engine benchmark's closed batches of 32, where k = 0 led and the start-up put
k = 2 and 3 at 0.78 and 0.67 of it, probed both at once, 6 steps each at 3.3
and 4.5 times k = 0's step: the first batches of 32 ran 0.85-0.92 of fixed
k = 0. A depth out of reach is left to the probes that probe_budget paces, in a closed batch. An
open batch (a server, whose life is long next to 4 steps per depth and bucket) probes every depth
early: served at concurrency 32 the start-up, its dummy steps as noisy as served ones, put k = 2 at
batch 32 at 2.5 times k = 1's step where it ran about 1.5 times (quiet, its dummy steps said 1.5),
its score at 0.55 of k = 1's; the paced probes, priced on that estimate, came 1000+ steps apart, and
the policy held k = 1 for the whole level (0.89 of fixed k = 3). And a probe's step counts up to
outlier_ratio squared off an estimate that is the start-up's alone, not outlier_ratio.

While the policy holds k = 0, nothing is learnt of the drafts until the
next probe, and the last probe's verifies are the best estimate there is;
decayed every step, they fell to the prior (p = 0.5) within a few dozen
steps, where the draft agreed 80-95% of the time, and at concurrency 32 the
policy held k = 0 (mean k 0.12, 0.85x the best fixed k) between probes
200-400 steps apart. Steps that verify no draft age the counts only down
to `hold_weight` (1) verifies of draft 1: the estimate stands, and the next
probe's verifies outweigh it (kept whole, the counts of a draft gone bad,
tens of verifies, would outweigh the few of the probes after it recovered).

A request's first drafts agree less than its later ones (bench preset,
closed batches of 32 at k = 3: 1.5-1.8 of 3 drafts accepted a step in
the first three steps, 2.5-2.9 later), and a server whose 32 requests
started together fell to k = 0 on them; there the dip's estimate stood
(above), and a probe of k = 3, three steps at three times k = 0's cost,
waited ~300 steps for probe_budget: most of the burst ran at k = 0 (mean
k 0.15-0.7 over a level, 0.82-0.90x the best fixed k), where k = 3 ran
1.2 times faster. So a policy whose open batch falls to k = 0 probes the
depth it left `recheck_steps` (32) later, whatever that costs, once; a
draft gone bad pays one probe for it. (A closed batch's choice already
weighs each sequence's own and the long-run acceptance.) A fall to k = 0
at a change of bucket may be no dip: the engine benchmark's closed batches of
32 end with one sequence at k = 3, the next batch's first (open) step fell
to k = 0 at 32, and the recheck then probed k = 3 at batch 32 in every
batch, three steps at 4.5 times k = 0's (~10% of the batch's time). So a
recheck that comes due in a closed batch is dropped. (It used to be that
only a fall within a bucket was rechecked; served at concurrency 32, a
level's first steps, after the last level's tail of a few sequences had
put p_1 and p_2 at 0.68 and 0.57, fell to k = 0 as the batch grew to 32,
and held it for 3 s, ~120 steps, until the paced probe of k = 2 brought
k = 3 back: ~40% of the server's turn.)

The choice itself is cheap but not free (the scores: 4 us at batch 1, 7 at
batch 16, where a graph-mode step at batch 1 is 0.8 ms), and from one step to
the next it barely moves: an open batch's choice is revised every
`revise_interval` (4) steps, and at once when the batch moves to another
bucket or a probe ends (the policy's bookkeeping a step, choice and evidence:
9.9 -> 5.6 us at batch 1, 10.8 -> 4.6 us at batch 16); a closed batch's
choice, too, is made anew when a probe ends. Those are warm
figures; between two model steps the bookkeeping runs with its code and data
out of the CPU's caches, several times slower: with a cache-sized sweep of
memory between steps, its five calls a step took 31 us at batch 1, and an
adaptive engine's host time a decode step at k = 3 was 98 us against a fixed
k = 3 engine's 64 (bench preset, graph mode, batch 1: ~2% of a 1.9 ms step).
So `choose` takes a shortcut through the steps that neither revise nor probe
(the same choice: only counters move), and a single verify (batch 1) is
counted without the histogram a batch's verifies take: 23 us, and 94 us of
host time a step. A closed batch's steps between the drain's revisions take
the shortcut too. Cold, the drain's cost is mostly its count of array
operations (several us each, against ~1 warm): its per-sequence estimates are
made in one pass of the interpreter and only the draws are arrays (engine,
batch 4, the old code and this one on the same calls, each first on every
second call: 600 -> 448 us; batch 16: 715 -> 676 us).

Timings are noisy: the start-up seeds each cost with the median of its dummy
steps (their mean let one slow step of five make k = 0 at batch 4 look 1.7
times its cost, and the policy speculated where k = 0 was 15% faster), and a
step more than `outlier_ratio` (1.5) times off its estimate moves it as one
1.5 times off does.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

TRACE_ENV = "MTP_SPEC_POLICY_TRACE"  # a file: the adaptive policy appends one JSON line per revision and probe
MAX_DRAIN_INTERVAL = 32  # steps between a closed batch's revisions, at most (AdaptivePolicy.drain_budget)


def batch_bucket(batch_size: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share a cost estimate: the bucket's upper end."""
    if batch_size < 1:
        raise ValueError(f"batch_bucket: batch size {batch_size} must be >= 1")
    return 1 << (batch_size - 1).bit_length()


def bucket_sizes(max_batch: int) -> list[int]:
    """The buckets a batch of at most `max_batch` sequences can fall in, as the batch size the
    warm-up measures for each (the bucket's upper end, or max_batch for the last)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class FixedPolicy:
    """Every step verifies k drafts (the engine without --speculative_adaptive)."""

    adaptive = False

    def __init__(self, k: int):
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"FixedPolicy: k={k!r} must be an integer >= 0")
        self.k = self.max_k = k

    def choose(self, batch_size: int, draining=None) -> int:
        return self.k

    def record_step(self, k: int, batch_size: int, seconds: float) -> None:
        pass

    def record_verify(self, real_drafts: int, accepted: int) -> None:
        pass

    def record_finished(self, tried: list[int], accepted: list[int]) -> None:
        pass

    def end_step(self) -> None:
        pass

    def describe(self) -> dict:
        return {"speculative_policy": "fixed", "num_speculative_tokens": self.k}


@dataclass
class _Cost:
    seconds: float
    samples: int = 1
    live: int = 1  # steps served that timed it (0: the start-up's dummy steps alone)
    early: int = 0  # probes started to time it live for the first time (`_choose`)


@dataclass
class AdaptivePolicy:
    """Picks k in 0..max_k every step (module docstring)."""

    max_k: int
    decay: float = 0.9  # per step; the counts of the last ~1 / (1 - decay) steps dominate
    # ... and of the last ~1 / (1 - verify_decay) verifies at least, whatever the batch size: a step decays
    # them by max(decay, verify_decay ** its verifies) (module docstring)
    verify_decay: float = 0.97
    cost_smoothing: float = 0.05  # weight of a new step time in its (k, bucket) cost at unit load
    load_smoothing: float = 0.3  # weight of a new step time in its bucket's load factor
    probe_cost_smoothing: float = 0.6  # weight of a probe (a depth not in use) in that depth's cost (module docstring)
    # steps between probes (jittered +-25%); each costs a few tokens (a step at the probed k, the next
    # one's filler), about 1% of the tokens at this interval
    probe_interval: int = 128
    # the gap between probes doubles after each probe that changed nothing, up to this many times the
    # interval; a change of depth, or a probe whose depth scored within probe_close of the depth in use,
    # sets it back (module docstring)
    probe_backoff: int = 4
    probe_close: float = 0.1
    # ... and a probe whose steps cost more than the depth in use's waits until that extra is at most this
    # share of the time since the last probe (module docstring)
    probe_budget: float = 0.02
    probe_steps: int = 6  # (module docstring: its timed steps count as one)
    # a depth whose cost in a bucket is the start-up's alone is probed at once, up to this many times (module
    # docstring)
    early_probes: int = 3
    early_reach: float = 0.2  # ... if its score on the start-up's costs is at least 1 - this of the depth in use's
    # a probe's step counts once the depth in use has timed this many steps of its batch size since it came
    # into use (module docstring)
    reference_steps: int = 4
    cold_steps: int = 2  # steps after a change of depth that are not timed (module docstring)
    settle_steps: int = 8  # a closed batch's steps after sequences join it that are not timed (module docstring)
    # a policy fallen to k = 0 probes the depth it left this many steps later, whatever it costs (module docstring)
    recheck_steps: int = 32
    # an open batch's choice is revised every this many steps, at once when its bucket changes or a
    # probe ends (module docstring)
    revise_interval: int = 4
    switch_margin: float = 0.03
    outlier_ratio: float = 1.5  # a step time moves its estimate as one at most this many times off it does
    prior_acceptance: float = 0.5  # p_1 before any evidence (p_j's: p_{j-1}'s estimate), weight prior_weight (verifies)
    prior_weight: float = 0.1
    # steps that verify no draft (k = 0) age the counts down to this many verifies of draft 1, no further
    hold_weight: float = 1.0
    # a sequence's own verifies that weigh as much as the policy's estimate in its acceptance (closed batches)
    sequence_prior_weight: float = 4.0
    # ... and in a finished sequence's ratios, which give the spread (module docstring)
    spread_prior_weight: float = 1.0
    long_decay: float = 0.995  # per step, for the long-run acceptance a closed batch's sequences start from
    drain_interval: int = 4  # a closed batch's choice is revised every this many steps, at least
    # ... and no more often than lets its estimate take this share of the steps' time (at most every 32)
    drain_budget: float = 0.005
    # ... and this many times less often for every switch margin its best depth leads the next by (module docstring)
    drain_lead_hold: float = 1.0
    spread_window: int = 64  # finished sequences whose acceptance gives a closed batch's spread
    drain_samples: int = 64  # draws of each sequence's steps to finish a closed batch (module docstring)
    # what drafting costs beside the decode steps: the draft's pass over each prompt (module docstring)
    draft_pass_smoothing: float = 0.2  # per pass, the decay of the earlier ones' positions and seconds
    request_decay: float = 0.95  # per finished request, for the prompt tokens drafted per output token
    overhead_smoothing: float = 0.1  # weight of a step's host time in its (k, bucket) estimate
    seed: int = 0
    # where each full choice and each probe's result go, one JSON object a line (make_policy: $MTP_SPEC_POLICY_TRACE);
    # None: nowhere. Only the steps that revise the choice or end a probe write, not the shortcut's.
    trace: object = None
    adaptive = True
    # Decayed counts, stored scaled: a count is the stored value / its scale. Decaying every count each
    # step is then one division of the scale (the policy's bookkeeping is paid on every decode step).
    _tries: list[float] = field(init=False)
    _hits: list[float] = field(init=False)
    _scale: float = field(init=False, default=1.0)
    _long_tries: list[float] = field(init=False)  # the same counts, decayed by long_decay
    _long_hits: list[float] = field(init=False)
    _long_scale: float = field(init=False, default=1.0)
    _costs: dict[tuple[int, int], _Cost] = field(init=False, default_factory=dict)  # at unit load
    _load: dict[int, float] = field(init=False, default_factory=dict)  # per bucket
    _overhead: dict[int, float] = field(init=False, default_factory=dict)  # per bucket: host seconds a step
    # (bucket, batch size) -> the depth in use's recent step time there, what a probe is compared with in an
    # open batch, its steps timed there since it came into use (a probe waits for reference_steps of them),
    # and its last few step times there (as many as a probe times), the cheapest of which a closed batch's
    # probe is compared with
    _reference: dict[tuple[int, int], list] = field(init=False, default_factory=dict)
    _probe_timed_steps: int = field(init=False, default=1)  # probe_steps - cold_steps
    _probe_closed: bool = field(init=False, default=False)  # the last full choice was a closed batch's
    _evidence: int = field(init=False, default=0)  # the verifies of real drafts this step (end_step decays)
    _current: int = field(init=False, default=0)
    _probe_left: int = field(init=False, default=0)
    _probe_k: int = field(init=False, default=0)
    # the probe's timed steps so far: (k, bucket, their cost at unit load (a closed batch's cheapest, an open
    # batch's mean), the batch size of its last step or the cheapest, how many were timed)
    _probe_timed: tuple | None = field(init=False, default=None)
    _until_probe: int = field(init=False, default=0)
    _probe_turns: dict[int, int] = field(init=False, default_factory=dict)  # per bucket: probe times so far
    _probe_scale: int = field(init=False, default=1)  # the probe interval's multiple now (probe_backoff)
    _probe_close_call: bool = field(init=False, default=True)  # a probe since the last probe time came close
    _since_probe: int = field(init=False, default=0)  # choices since the last probe time
    _recheck: int = field(init=False, default=0)  # the depth left for k = 0, to probe at once (0: none)
    _last_batch: int = field(init=False, default=0)  # the batch size of the last choice
    _drain_wait: int = field(init=False, default=0)
    _drain_bucket: int = field(init=False, default=0)  # the batch bucket a closed batch's choice was last made at
    _revise_wait: int = field(init=False, default=0)  # steps until an open batch's choice is revised
    _revise_bucket: int = field(init=False, default=0)  # the batch bucket it was last revised for
    _steady_size: int = field(init=False, default=0)  # the batch size of the last open batch's choice (0: none)
    _verified: bool = field(init=False, default=False)  # a real draft has been verified (a fresh policy has not)
    _untimed: int = field(init=False, default=0)  # chosen steps still to come that are not timed (a fresh probe)
    _timing: bool = field(init=False, default=True)  # whether the step chosen last is timed
    # the k of the last cold_steps + 1 steps chosen, the last one's last (empty: no step chosen yet)
    _recent_k: deque = field(init=False)
    _rng: random.Random = field(init=False)
    # per finished sequence, its E[k] over the long-run estimate's, k = 0..max_k (`record_finished`)
    _spread: deque = field(init=False)
    _spread_array: np.ndarray | None = field(init=False, default=None)  # the same as [window, k], made on use
    # batch size -> the drain's draws: [drain_samples, n] N(0, 1) and U[0, 1) (which finished sequences)
    _drain_noise: dict = field(init=False, default_factory=dict)
    _odd: np.ndarray = field(init=False)  # 2j - 1 for j = 1..max_k
    _pass_positions: float = field(init=False, default=0.0)  # decayed sums over the draft's passes
    _pass_seconds: float = field(init=False, default=0.0)
    _prompt_tokens: float = field(init=False, default=0.0)  # decayed sums over finished requests
    _output_tokens: float = field(init=False, default=0.0)
    _requests: float = field(init=False, default=0.0)
    # set by the engine: a greedy prompt's first drafts wait for its first decode step (graph mode), which
    # verifies filler (module docstring)
    first_drafts_deferred: bool = field(init=False, default=False)
    # set by the engine: the positions of the running sequences the draft has not passed over (the keys steps
    # at k = 0 left out), which the first step at k > 0 fills; asked only when a probe up is due
    unseen_positions: object = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.max_k, int) or self.max_k < 1:
            raise ValueError(f"AdaptivePolicy: max_k={self.max_k!r} must be an integer >= 1 "
                             f"(--num_speculative_tokens is the largest k adaptive depth may choose)")
        if not 0 < self.decay <= 1 or not 0 < self.long_decay <= 1:
            raise ValueError(f"AdaptivePolicy: decay={self.decay} and long_decay={self.long_decay} must lie in (0, 1]")
        if not all(0 < w <= 1 for w in (self.cost_smoothing, self.load_smoothing, self.probe_cost_smoothing)):
            raise ValueError(f"AdaptivePolicy: cost_smoothing={self.cost_smoothing}, load_smoothing="
                             f"{self.load_smoothing} and probe_cost_smoothing={self.probe_cost_smoothing} "
                             f"must lie in (0, 1]")
        if not 0 <= self.early_reach <= 1:
            raise ValueError(f"AdaptivePolicy: early_reach={self.early_reach} must lie in [0, 1]")
        if self.early_probes < 0 or self.reference_steps < 1:
            raise ValueError(f"AdaptivePolicy: early_probes={self.early_probes} must be >= 0 and reference_steps="
                             f"{self.reference_steps} >= 1")
        if self.hold_weight < 0:
            raise ValueError(f"AdaptivePolicy: hold_weight={self.hold_weight} must be >= 0")
        if self.sequence_prior_weight <= 0 or self.spread_prior_weight <= 0:
            raise ValueError(f"AdaptivePolicy: sequence_prior_weight={self.sequence_prior_weight} and "
                             f"spread_prior_weight={self.spread_prior_weight} must be > 0")
        if min(self.probe_interval, self.drain_interval, self.probe_backoff, self.revise_interval,
               self.recheck_steps) < 1:
            raise ValueError("AdaptivePolicy: probe_interval, drain_interval, probe_backoff, revise_interval and "
                             "recheck_steps must be >= 1")
        if not 0 <= self.probe_close < 1:
            raise ValueError(f"AdaptivePolicy: probe_close={self.probe_close} must lie in [0, 1)")
        if self.probe_budget <= 0:
            raise ValueError(f"AdaptivePolicy: probe_budget={self.probe_budget} must be > 0")
        if self.outlier_ratio <= 1:
            raise ValueError(f"AdaptivePolicy: outlier_ratio={self.outlier_ratio} must be > 1")
        if self.drain_budget <= 0 or self.drain_lead_hold < 0:
            raise ValueError(f"AdaptivePolicy: drain_budget={self.drain_budget} must be > 0 and drain_lead_hold="
                             f"{self.drain_lead_hold} >= 0")
        if self.settle_steps < 0:
            raise ValueError(f"AdaptivePolicy: settle_steps={self.settle_steps} must be >= 0")
        if self.cold_steps < 0 or self.probe_steps < self.cold_steps + 1:
            raise ValueError(f"AdaptivePolicy: probe_steps={self.probe_steps} must be >= cold_steps + 1 = "
                             f"{self.cold_steps + 1} (a probe's first {self.cold_steps} steps run cold and are "
                             f"not timed), and cold_steps >= 0")
        self._recent_k = deque(maxlen=self.cold_steps + 1)
        self._probe_timed_steps = self.probe_steps - self.cold_steps
        self._tries = [0.0] * self.max_k
        self._hits = [0.0] * self.max_k
        self._long_tries = [0.0] * self.max_k
        self._long_hits = [0.0] * self.max_k
        if not 0 < self.draft_pass_smoothing <= 1 or not 0 < self.request_decay <= 1:
            raise ValueError(f"AdaptivePolicy: draft_pass_smoothing={self.draft_pass_smoothing} and "
                             f"request_decay={self.request_decay} must lie in (0, 1]")
        if self.drain_samples < 1:
            raise ValueError(f"AdaptivePolicy: drain_samples={self.drain_samples} must be >= 1")
        if self.spread_window < 0:
            raise ValueError(f"AdaptivePolicy: spread_window={self.spread_window} must be >= 0")
        self._rng = random.Random(self.seed)
        self._until_probe = self._next_probe_gap()
        self._spread = deque(maxlen=self.spread_window)
        self._odd = 2.0 * np.arange(1, self.max_k + 1) - 1.0

    # evidence ------------------------------------------------------------------

    def record_verify(self, real_drafts: int, accepted: int) -> None:
        """One sequence's verify: `real_drafts` drafts from the draft model (filler after them is no
        evidence), `accepted` of the step's drafts accepted. Draft j (1-based) was tried when the j-1
        before it were accepted."""
        self.record_verifies(((real_drafts, accepted),))

    def record_verifies(self, verifies) -> None:
        """A step's verifies, (real drafts, accepted) per sequence (`record_verify`)."""
        K = self.max_k
        scale, long_scale = self._scale, self._long_scale
        if len(verifies) == 1:  # (batch 1: drafts 1..min(accepted + 1, real) tried, 1..accepted accepted)
            real, accepted = verifies[0]
            real = min(real, K)
            if real < 1:
                return
            accepted = min(accepted, real)
            self._verified = True
            self._evidence += 1
            tries, long_tries, hits, long_hits = self._tries, self._long_tries, self._hits, self._long_hits
            for j in range(min(accepted + 1, real)):
                tries[j] += scale
                long_tries[j] += long_scale
            for j in range(accepted):
                hits[j] += scale
                long_hits[j] += long_scale
            return
        tried_to = [0] * (K + 1)  # sequences whose drafts 1..j were tried, at j
        hit_to = [0] * (K + 1)
        for real, accepted in verifies:  # (no min(): this runs on every step, between two model steps)
            if real > K:
                real = K
            if accepted > real:
                accepted = real
            tried_to[accepted + 1 if accepted < real else real] += 1
            hit_to[accepted] += 1
        tried = hit = 0
        verified = len(verifies) - tried_to[0]  # (real drafts)
        if verified:
            self._verified = True
            self._evidence += verified
        for j in range(K, 0, -1):  # draft j was tried by every sequence that reached j or more
            tried += tried_to[j]
            hit += hit_to[j]
            if tried:
                self._tries[j - 1] += tried * scale
                self._long_tries[j - 1] += tried * long_scale
            if hit:
                self._hits[j - 1] += hit * scale
                self._long_hits[j - 1] += hit * long_scale

    def record_step(self, k: int, batch_size: int, seconds: float) -> None:
        """The wall time of a step of `batch_size` decoding sequences at depth k (decode-only
        steps, or the one-call decode part of a step that also prefilled, timed on its own: a prompt
        chunk in the timing would charge its prefill to k), the step `choose` gave k last. Not timed
        when one of the `cold_steps` steps before it ran another depth (module docstring); steps
        recorded without `choose` (the start-up's) are timed as given."""
        if not 0 <= k <= self.max_k or batch_size < 1 or seconds <= 0 or not self._timing:
            return
        if self._recent_k.count(k) != len(self._recent_k):  # (one of the last few steps ran another depth)
            return
        bucket = batch_bucket(batch_size)
        key = (k, bucket)
        load = self._load.setdefault(bucket, 1.0)
        cost = self._costs.get(key)
        if cost is None:
            self._costs[key] = _Cost(seconds / load)
            if k == self._current:
                self._reference[(bucket, batch_size)] = [seconds, 1, deque((seconds,), maxlen=self._probe_timed_steps)]
            return
        if k != self._current:
            self._record_probe(k, bucket, batch_size, seconds, cost)
            return
        cost.samples += 1
        cost.live += 1
        raw = seconds
        # A step that ran far from its estimate (a pause of the process, another job's burst on its
        # core) moves it as one 1.5 times off would: one such step made a depth look 50% dearer.
        expected = cost.seconds * load
        seconds = min(max(seconds, expected / self.outlier_ratio), expected * self.outlier_ratio)
        # what a probe at this batch size is compared with (`_record_probe`): a smoothed time, and (closed
        # batches) its last few steps as they ran, the cheapest of which a probe's cheapest is set against
        reference = self._reference.get((bucket, batch_size))
        if reference is None:
            reference = self._reference[(bucket, batch_size)] = [seconds, 0, deque(maxlen=self._probe_timed_steps)]
        reference[2].append(raw)
        reference[0] += self.load_smoothing * (seconds - reference[0])
        reference[1] += 1
        # how much slower than its estimate this k ran just now: the whole bucket's load moves
        self._load[bucket] = load = load + self.load_smoothing * (seconds / cost.seconds - load)
        # then the k's own cost at unit load: the mean of its first samples, then a slow EMA
        cost.seconds += max(self.cost_smoothing, 1.0 / cost.samples) * (seconds / load - cost.seconds)

    def _record_probe(self, k: int, bucket: int, batch_size: int, seconds: float, cost: _Cost) -> None:
        """A timed step at a depth not in use (a probe): how it compares with the depth in use's recent
        steps of the same batch size gives this depth's own cost. A probe's timed steps count as one (a
        closed batch's cheapest, an open batch's mean: module docstring), once its last step is in."""
        reference = self._reference.get((bucket, batch_size))
        base = self._costs.get((self._current, bucket))
        if reference is None or reference[1] < self.reference_steps or base is None:
            return  # the depth in use has not run this batch size lately, or only its first, cold steps
        pending = self._probe_timed
        if pending is not None and pending[:2] != (k, bucket):
            self._end_probe()  # (its timed steps fell in two buckets: each counts in its own)
            pending = None
        # this depth's cost at unit load (module docstring): a closed batch's cheapest step against the
        # cheapest of the depth in use's last ones, an open batch's mean against their smoothed mean
        timed = 1 if pending is None else pending[4] + 1
        if self._probe_closed:
            unit = seconds / min(reference[2]) * base.seconds
            if pending is not None and unit >= pending[2]:
                unit, batch_size = pending[2:4]
        else:  # (each step bounded as the depth in use's are, then the running mean)
            unit = seconds / reference[0] * base.seconds
            bound = self._probe_bound(cost)
            unit = min(max(unit, cost.seconds / bound), cost.seconds * bound)
            if pending is not None:
                unit = pending[2] + (unit - pending[2]) / timed
        self._probe_timed = (k, bucket, unit, batch_size, timed)
        if not self._probe_left:  # (a step recorded outside a probe, or a probe's last)
            self._end_probe()

    def _end_probe(self) -> None:
        """A probe's timed steps, as one, set its depth's cost, fast (module docstring)."""
        k, bucket, unit, batch_size, _ = self._probe_timed
        self._probe_timed = None
        cost = self._costs[(k, bucket)]
        cost.samples += 1
        bound = self._probe_bound(cost)
        unit = min(max(unit, cost.seconds / bound), cost.seconds * bound)
        # the first step served at this depth replaces the start-up's estimate (module docstring)
        weight = max(self.probe_cost_smoothing, 1.0 / cost.samples) if cost.live else 1.0
        before = cost.seconds
        cost.seconds += weight * (unit - cost.seconds)
        cost.live += 1
        if self.trace is not None:
            self._write_trace("probe_result", k=k, bucket=bucket, batch=batch_size, current=self._current,
                              measured=unit, before=before, after=cost.seconds, load=self._load.get(bucket, 1.0),
                              current_unit=self._costs[(self._current, bucket)].seconds
                              if (self._current, bucket) in self._costs else None)
        scores = self.scores(batch_size)  # (its verifies, if any, are in: the engine records them first)
        if scores[self._current] and (scores[k] or 0.0) >= (1.0 - self.probe_close) * scores[self._current]:
            self._probe_close_call = True

    def _probe_bound(self, cost: _Cost) -> float:
        """How far off its depth's estimate a probe's step counts: outlier_ratio, or its square where the
        estimate is the start-up's alone (served, one of them was 1.6 times what the depth ran)."""
        return self.outlier_ratio if cost.live else self.outlier_ratio ** 2

    def record_overhead(self, k: int, batch_size: int, seconds: float) -> None:
        """A decode step's host time outside the model (a step at depth k): from its start to the next
        step's, less the model's time; one estimate per bucket serves every depth (module docstring). A
        step more than outlier_ratio off the estimate moves it as one that far off does."""
        if not 0 <= k <= self.max_k or batch_size < 1 or seconds < 0:
            return
        key = batch_bucket(batch_size)
        estimate = self._overhead.get(key)
        if estimate is None:
            self._overhead[key] = seconds
            return
        if estimate > 0:
            seconds = min(max(seconds, estimate / self.outlier_ratio), estimate * self.outlier_ratio)
        self._overhead[key] = estimate + self.overhead_smoothing * (seconds - estimate)

    def overhead(self, k: int, batch_size: int) -> float:
        """The host seconds of a step (at depth k: every depth has its bucket's) for this batch size: its
        bucket's estimate, else the nearest bucket's; 0 before any step was measured."""
        bucket = batch_bucket(batch_size)
        exact = self._overhead.get(bucket)
        if exact is not None:  # (the common case, on every step's scores: no scan)
            return exact
        known = [(abs(b.bit_length() - bucket.bit_length()), b, seconds) for b, seconds in self._overhead.items()]
        return min(known)[2] if known else 0.0

    def seed_step_cost(self, k: int, batch_size: int, seconds: list[float]) -> None:
        """The start-up's timings of dummy steps at depth k and this batch size: their median is the
        cost (their mean let one slow step, of five, make k = 0 at batch 4 look 1.7 times its cost)."""
        if not 0 <= k <= self.max_k or batch_size < 1 or not seconds or min(seconds) <= 0:
            raise ValueError(f"AdaptivePolicy.seed_step_cost: k={k} (0..{self.max_k}), batch size {batch_size} "
                             f"and {len(seconds)} timings, all > 0, are needed")
        bucket = batch_bucket(batch_size)
        self._costs[(k, bucket)] = _Cost(statistics.median(seconds) / self._load.setdefault(bucket, 1.0),
                                         len(seconds), live=0)

    def record_draft_pass(self, positions: int, seconds: float) -> None:
        """The draft's pass over `positions` positions it had not seen, outside the decode steps: a
        prompt's (its keys, and the first drafts from its last position) or the fill of the keys that
        steps at k = 0 left out (ModelRunner.take_draft_pass). Its cost per position is the ratio of
        decayed sums, so that a small pass, mostly fixed costs, counts for its few positions only."""
        if positions < 1 or seconds <= 0:
            return
        keep = 1.0 - self.draft_pass_smoothing
        self._pass_positions = self._pass_positions * keep + positions
        self._pass_seconds = self._pass_seconds * keep + seconds

    def record_request(self, prompt_tokens: int, output_tokens: int) -> None:
        """A finished request's prompt and output lengths: how many prompt positions the draft must
        pass over per token decoded (module docstring)."""
        if prompt_tokens < 0 or output_tokens < 1:
            return
        self._prompt_tokens = self._prompt_tokens * self.request_decay + prompt_tokens
        self._output_tokens = self._output_tokens * self.request_decay + output_tokens
        self._requests = self._requests * self.request_decay + 1

    def draft_pass_seconds(self) -> tuple[float, float]:
        """(seconds per position of the draft's pass over a prompt or a fill, prompt positions per
        output token); 0 where not measured yet."""
        ratio = self._prompt_tokens / self._output_tokens if self._output_tokens else 0.0
        position = self._pass_seconds / self._pass_positions if self._pass_positions else 0.0
        return position, ratio

    def end_step(self) -> None:
        """Once per engine step, after its evidence: older counts weigh less. A step that verified no draft
        (k = 0) ages them only while draft 1's count stays at hold_weight verifies or more, so that the
        last probe's acceptance stands until the next probe, whose verifies outweigh it (module
        docstring)."""
        if self._evidence:
            ratio = self.verify_decay ** self._evidence
            if ratio > self.decay:  # (few verifies: the verifies' window is the longer)
                self._scale /= ratio
                # the drafts past this step's depth were not verified: they age by the steps' window
                # (module docstring)
                extra = self.decay / ratio
                tries, hits = self._tries, self._hits
                for j in range(self._recent_k[-1] if self._recent_k else self.max_k, self.max_k):
                    tries[j] *= extra
                    hits[j] *= extra
            else:
                self._scale /= self.decay
            self._evidence = 0
            self._long_scale /= self.long_decay
        else:
            if self._tries[0] * self.decay >= self.hold_weight * self._scale:
                self._scale /= self.decay
            if self._long_tries[0] * self.long_decay >= self.hold_weight * self._long_scale:
                self._long_scale /= self.long_decay
        if self._scale > 1e100 or self._long_scale > 1e100:  # fold the scales into the counts
            for counts, scale in ((self._tries, self._scale), (self._hits, self._scale),
                                  (self._long_tries, self._long_scale), (self._long_hits, self._long_scale)):
                counts[:] = [c / scale for c in counts]
            self._scale = self._long_scale = 1.0

    # estimates -----------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """p_j for j = 1..max_k: chance that draft j is accepted given the drafts before it were."""
        return self._rates(self._hits, self._tries, self._scale)

    def long_run_acceptance(self) -> list[float]:
        """p_j over the last ~1 / (1 - long_decay) steps: what a sequence that has not verified yet is
        expected to accept in a closed batch (the recent estimate, at the end of a batch, is that of its
        slowest sequences alone)."""
        return self._rates(self._long_hits, self._long_tries, self._long_scale)

    def _rates(self, hits: list[float], tries: list[float], scale: float) -> list[float]:
        """Decayed counts -> rates, each shrunk by prior_weight verifies towards a prior: for draft 1
        prior_acceptance, for draft j > 1 the estimate of draft j - 1. A depth the policy is not using
        gets no evidence between probes, and its counts decay to nothing within a few dozen steps; with
        a fixed prior its rate would then fall to prior_acceptance, making the depths past the current
        one look poor however well the draft does (a draft that agrees 90% of the time at position 2
        was valued at 50% at position 3, and the policy stayed below the best depth for hundreds of
        steps). Without evidence of its own, a deeper draft is expected to do as well as the one
        before it, the first as well as the prior says."""
        w, prior = self.prior_weight * scale, self.prior_acceptance  # counts are stored times scale
        rates = []
        for h, t in zip(hits, tries):
            prior = (h + w * prior) / (t + w)
            rates.append(prior)
        return rates

    def expected_tokens(self, k: int) -> float:
        """Tokens one sequence gains from a step at depth k (the verified token plus accepted drafts)."""
        return self.expected_tokens_by_depth()[k]

    def expected_tokens_by_depth(self) -> list[float]:
        """expected_tokens(k) for k = 0..max_k."""
        out, total, run = [1.0], 1.0, 1.0
        for p in self.acceptance():
            run *= p
            total += run
            out.append(total)
        return out

    def cost(self, k: int, batch_size: int) -> float | None:
        """Estimated seconds of a step at depth k for this batch size, the host's time around the model
        included: its bucket's estimate, else the nearest measured bucket's; None when depth k was
        never measured."""
        model = self._model_cost(k, batch_bucket(batch_size))
        return None if model is None else model + self.overhead(k, batch_size)

    def _model_cost(self, k: int, bucket: int) -> float | None:
        """cost() less the host's time."""
        cost = self._costs.get((k, bucket))
        if cost is None:
            known = [(abs(b.bit_length() - bucket.bit_length()), b) for kk, b in self._costs if kk == k]
            if not known:
                return None
            bucket = min(known)[1]
            cost = self._costs[(k, bucket)]
        return cost.seconds * self._load.get(bucket, 1.0)

    def step_costs(self, batch_size: int) -> list[float | None]:
        """cost(k, batch_size) for k = 0..max_k, each at least that of every smaller k: a step at k does
        all the work of one at k - 1 and more (timing noise would otherwise make a deep, useless k look
        cheap). None where depth k was never measured."""
        bucket = batch_bucket(batch_size)
        host = self.overhead(0, batch_size)  # (one for every depth, looked up once)
        out: list[float | None] = []
        floor = 0.0
        for k in range(self.max_k + 1):
            c = self._model_cost(k, bucket)
            if c is not None:
                floor = max(floor, c + host)
            out.append(None if c is None else floor)
        return out

    def scores(self, batch_size: int) -> list[float | None]:
        """Expected tokens per second of each sequence at each depth (None: no cost measured yet). At
        k > 0 the draft's pass over the prompts of the requests to come is charged per token: a
        sequence's E[k] tokens of a step bring E[k] x (prompt positions per output token) positions
        of it (module docstring)."""
        costs = self.step_costs(batch_size)
        position, ratio = self.draft_pass_seconds()
        per_token = batch_size * position * ratio
        expected = self.expected_tokens_by_depth()
        decoded = self._output_tokens - self._requests  # tokens of decode steps (a prompt's step makes one)
        if self.first_drafts_deferred and decoded > 0:
            # a request's first decode step verifies filler: its m decode tokens take 1 + (m - 1) / E steps
            per_request = self._requests / decoded
            expected = [e / (1.0 + per_request * (e - 1.0)) for e in expected]
        return [None if c is None else e / (c + (per_token * e if k else 0.0))
                for k, (e, c) in enumerate(zip(expected, costs))]

    def sequence_expected_tokens(self, tried: list[int], accepted: list[int],
                                 acceptance: list[float] | None = None, weight: float | None = None) -> list[float]:
        """E[k] for k = 0..max_k of one sequence whose draft j was tried tried[j-1] times and accepted
        accepted[j-1] times (Sequence.tried_per_position / accepted_per_position): its own rates,
        shrunk towards `acceptance` (default: `long_run_acceptance()`) by `weight` verifies (default:
        `sequence_prior_weight`)."""
        w = self.sequence_prior_weight if weight is None else weight
        out, total, run = [1.0], 1.0, 1.0
        for j, p in enumerate(self.long_run_acceptance() if acceptance is None else acceptance):
            t = tried[j] if j < len(tried) else 0
            h = accepted[j] if j < len(accepted) else 0
            run *= (h + w * p) / (t + w)
            total += run
            out.append(total)
        return out

    def record_finished(self, tried: list[int], accepted: list[int]) -> None:
        """A finished sequence's verifies (Sequence.tried_per_position / accepted_per_position): how
        far its expected tokens at each depth were from the long-run estimate's (module docstring). A
        sequence that verified nothing says nothing."""
        if not tried or not tried[0] or not self.spread_window:
            return
        p = self.long_run_acceptance()
        own = self.sequence_expected_tokens(tried, accepted, p, self.spread_prior_weight)
        base = self.sequence_expected_tokens([], [], p)
        self._spread.append([o / e for o, e in zip(own, base)])
        self._spread_array = None

    def _spread_tokens(self, draining, p: list[float]) -> tuple[np.ndarray, np.ndarray]:
        """E_i[k] of every running sequence i: its own estimate (shrunk towards `p`), [k, i], and the same
        in each of the drain's draws s, [k, s, i] (one draw where no spread is known yet), moved by the
        share of the prior in it towards the ratios of a finished sequence drawn at random, the
        running sequences taking the draw's sequences in the order of their own estimates (module
        docstring)."""
        inputs = self._drain_inputs(draining, p)
        own = np.array(inputs[0]).T
        return own, self._drawn_tokens(own, inputs[1], inputs[2])

    def _drain_inputs(self, draining, p: list[float]) -> tuple[list, list, list, list, list, list, int]:
        """Per running sequence, in one pass of the interpreter (the drain runs between two model steps,
        its code and data out of the CPU's caches, where every array operation costs several us: module
        docstring): its own E_i[k] for k = 0..K (`sequence_expected_tokens`), its order at K (rank 0:
        fewest tokens a step), the prior's share in its estimate (sequence_prior_weight against its
        verifies of draft 1), the standard deviation of one step's tokens at each k, its tokens left
        and its one-token steps to come (at most its tokens left); and the positions the draft has not
        passed over, summed over the sequences."""
        K, w = self.max_k, self.sequence_prior_weight
        shrunk = [w * x for x in p]
        own, unsure, deviation, left, single, unseen = [], [], [], [], [], 0
        for d in draining:
            tried, hits = d[1], d[2]
            total = run = 1.0
            square = 0.0
            e, sd = [1.0], [0.0]
            for j in range(K):
                t = tried[j] if j < len(tried) else 0
                run *= ((hits[j] if j < len(hits) else 0) + shrunk[j]) / (t + w)
                total += run
                # one step's tokens: 1 + A, with P(A >= j) = E[j] - E[j - 1]; Var A = sum (2j - 1) P(A >= j) - (E A)^2
                square += (2 * j + 1) * run
                e.append(total)
                sd.append(math.sqrt(max(square - (total - 1.0) ** 2, 0.0)))
            own.append(e)
            deviation.append(sd)
            unsure.append(w / ((tried[0] if tried else 0) + w))
            r = max(0, d[0])
            left.append(r)
            single.append(min(d[4], r) if len(d) > 4 else 0)
            if len(d) > 3:
                unseen += d[3]
        rank = [0] * len(own)
        for position, i in enumerate(sorted(range(len(own)), key=lambda i: own[i][K])):
            rank[i] = position
        return own, rank, unsure, deviation, left, single, unseen

    def _drawn_tokens(self, own: np.ndarray, rank: list[int], unsure: list[float]) -> np.ndarray:
        """E_i[k] in each of the drain's draws, [k, s, i] (`_spread_tokens`): own [k, i]."""
        if len(self._spread) < 8:
            return own[:, None, :]
        ratios = self._spread_array
        if ratios is None:  # the window's ratios [k, window], its sequences slowest first (at max_k)
            rows = np.array(self._spread)
            ratios = self._spread_array = np.ascontiguousarray(rows[np.argsort(rows[:, -1], kind="stable")].T)
        _, picks = self._drain_draws(own.shape[1])
        # each draw's finished sequences, slowest first (the picks are sorted in each draw), to the running
        # ones in the order of their own estimates
        m = ratios[:, (picks * ratios.shape[1]).astype(np.intp)[:, rank]]  # [k, s, i]
        # own * (1 + unsure * (m - 1)), at least the one token a step always gains
        part = own * unsure
        m *= part[:, None, :]
        m += (own - part)[:, None, :]
        return np.maximum(m, 1.0, out=m)

    def _drain_draws(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The drain's fixed draws for n sequences (the same every choice, so that it repeats): N(0, 1)
        noise of each sequence's steps, and U[0, 1) picks of finished sequences, sorted in each draw."""
        draws = self._drain_noise.get(n)
        if draws is None:
            rng = np.random.default_rng(self.seed)
            draws = self._drain_noise[n] = (rng.standard_normal((self.drain_samples, n)),
                                            np.sort(rng.random((self.drain_samples, n)), axis=1))
        return draws

    def drain_scores(self, draining) -> list[float | None]:
        """For a closed batch (module docstring): tokens per second until every running sequence is done,
        at each depth held from now on (None: no cost measured yet). `draining`: (tokens left, tried
        per position, accepted per position[, positions the draft has not passed over[, steps to
        come that gain one token whatever k]]) of every running sequence (tokens left: those of
        its decode steps); at k > 0 the draft's pass over those positions is charged, and a
        sequence's one-token steps (a step that verifies filler: module docstring) come before
        its steps at E_i[k]."""
        n = len(draining)
        out: list[float | None] = [None] * (self.max_k + 1)
        if not n:
            return out
        # each bucket's costs, looked up once: buckets 1, 2, 4, ... up to the one of n sequences
        table = [self.step_costs(1 << j) for j in range((n - 1).bit_length() + 1)]
        measured = [k for k in range(self.max_k + 1) if all(costs[k] is not None for costs in table)]
        if not measured:
            return out
        own_rows, rank, unsure, deviation, left, single, unseen = self._drain_inputs(draining,
                                                                                   self.long_run_acceptance())
        own = np.array(own_rows).T  # E_i[k]: [k, sequence]
        e = self._drawn_tokens(own, rank, unsure)  # [k, draw, sequence]
        # a sequence's steps to finish: its one-token steps, then drafted / E steps, with standard deviation
        # sqrt(drafted Var / E^3) (in a draw its E_i[k] moves, its variance barely)
        drafted = [r - s for r, s in zip(left, single)]
        spread = np.array([[math.sqrt(t) * s for s in row] for t, row in zip(drafted, deviation)]).T  # [k, sequence]
        if len(measured) <= self.max_k:
            e, spread = e[measured], spread[measured]
        noise, _ = self._drain_draws(n)
        inverse = np.reciprocal(e)
        draws = spread[:, None, :] * noise  # [k, draw, sequence]
        draws *= inverse
        draws *= np.sqrt(inverse)
        inverse *= drafted
        draws += inverse
        draws += single
        np.maximum(draws, 0.0, out=draws)
        draws.sort(axis=2)
        # the m-th finish (m = 0..n-1), its mean over the draws, is finish[k, m] / len(noise); between the
        # (m-1)-th finish and the m-th, n - m sequences run: sum over m of (t_m - t_(m-1)) c_m is sum over m
        # of t_m (c_m - c_(m+1)), with c_n = 0, c_m the cost of a step of n - m sequences
        finish = draws.sum(axis=1)
        steps = [table[(n - m - 1).bit_length()] for m in range(n)] + [[0.0] * (self.max_k + 1)]
        running = np.array([[steps[m][k] - steps[m + 1][k] for m in range(n)] for k in measured])
        seconds = (finish * running).sum(axis=1).tolist()
        pass_seconds = unseen * self.draft_pass_seconds()[0]
        total = float(sum(left))
        for k, sec in zip(measured, seconds):
            sec = sec / len(noise) + (pass_seconds if k else 0.0)
            out[k] = total / sec if sec > 0 else float("inf")
        return out

    # the choice -------------------------------------------------------------------

    def choose(self, batch_size: int, draining=None) -> int:
        """The k of the next step, whose batch holds about `batch_size` decoding sequences. `draining`:
        given when the batch is closed (nothing waits, nothing will arrive), (tokens left, tried per
        position, accepted per position) of every running sequence, or a function that returns them
        (called only on the steps that revise the choice, with batch_size taken for their number);
        with two or more, the k that finishes them soonest is chosen (module docstring)."""
        if self._steady(batch_size, draining):
            # (most steps: between revisions, no probe due; what _choose does then, with less of the
            # interpreter's time between two model steps)
            self._since_probe += 1
            self._until_probe -= 1
            k = self._current
        else:
            k = self._choose(batch_size, draining)
        self._recent_k.append(k)
        self._timing = not self._untimed
        if self._untimed:
            self._untimed -= 1
        return k

    def _steady(self, batch_size: int, draining) -> bool:
        """Whether this step neither revises the choice nor probes (`choose`'s shortcut), counting it down
        as `_choose` would: an open batch of the size of the last choice between revisions, or a closed
        one, no larger, in a bucket no smaller than the one the drain's last choice was made at."""
        if self._probe_left or self._probe_timed is not None or (self._until_probe <= 1 and not self._untimed):
            return False
        if draining is None or (batch_size <= 1 if callable(draining) else len(draining) <= 1):
            if batch_size != self._steady_size or not self._revise_wait:
                return False
            self._revise_wait -= 1
        else:
            if not (self._probe_closed and self._drain_wait and batch_size <= self._last_batch
                    and 2 * batch_size > self._drain_bucket):
                return False
            self._drain_wait -= 1
            self._last_batch = batch_size
        return True

    def prompts_only(self) -> None:
        """The next step only prefills prompts (no sequence decodes in it): a probe under way ends now. Its
        steps left would make the draft pass over the prompts at the probed depth (the engine benchmark's
        batches of 16, k = 0 in use: a probe of k = 2 that the last batch's tail began prefilled the next
        batch at k = 2, 28 ms against 26) and then run on their first, cold decode steps."""
        self._probe_left = 0

    def _choose(self, batch_size: int, draining) -> int:
        if self._probe_left:
            self._probe_left -= 1
            return self._probe_k
        if self._probe_timed is not None:  # (its last step was not timed)
            self._end_probe()
        scores: list[float | None] | None
        bucket = batch_bucket(max(1, batch_size))
        closed = draining is not None and (batch_size > 1 if callable(draining) else len(draining) > 1)
        self._probe_closed = closed
        moved = False  # (an open batch's bucket changed since its last revision)
        grown, self._last_batch = batch_size > self._last_batch, batch_size
        if closed and grown:  # its prompts were just prefilled: its first steps run cold (module docstring)
            self._untimed = max(self._untimed, self.settle_steps)
        self._steady_size = 0 if closed else batch_size  # (choose's shortcut)
        if closed:
            # A drain's outlook changes slowly, and its estimate costs 0.1-0.2 ms (0.4-0.5 cold, between model
            # steps): next to a 1 ms step (batch 4 at k = 0) it was 4% of the run when made every fourth step.
            # Sequences admitted since the last choice (a new batch) make it anew: the last batch's tail had
            # chosen k = 3 at one sequence, and the next batch of 16 prefilled at that depth, paying the
            # draft's pass over its prompts, before its first revision fell back to k = 0. So does a fall to a
            # smaller bucket.
            if self._drain_wait and not grown and bucket >= self._drain_bucket:
                self._drain_wait -= 1
                scores = None
            else:
                started = time.perf_counter()
                scores = self.drain_scores(draining() if callable(draining) else draining)
                spent = time.perf_counter() - started
                step = self.cost(self._current, batch_size) or 0.0
                budget = math.ceil(spent / (self.drain_budget * step)) if step > 0 else 0
                wait = max(self.drain_interval, budget) * self._drain_lead(scores)
                self._drain_wait = int(min(wait, MAX_DRAIN_INTERVAL)) - 1
                self._drain_bucket = bucket
        else:
            self._drain_wait = 0
            # The scores (4 us at batch 1, on a graph-mode step of 0.8 ms) move little from one step to the next:
            # revised every few steps, at once in another bucket or after a probe (its evidence)
            moved = bucket != self._revise_bucket
            if self._revise_wait and not moved:
                self._revise_wait -= 1
                scores = None
            else:
                scores = self.scores(max(1, batch_size))
                self._revise_wait, self._revise_bucket = self.revise_interval - 1, bucket
        if scores is not None:
            unmeasured = [k for k, s in enumerate(scores) if s is None]
            if unmeasured:  # measure every depth once before trusting the comparison
                return self._start_probe(unmeasured[0])
            if self._current == 0 and not self._verified:
                # No draft verified yet (a fresh engine): the acceptance is the prior's, which values
                # speculation at little, and at k = 0 nothing would be learnt until the first probe, up to
                # 160 steps away; try the deepest k now. (Once drafts were verified the probes alone
                # bring speculation back: this test, when it asked whether any draft was verified in
                # the last few hundred steps, probed an engine held at k = 0 every ~220 steps besides.)
                # Its steps are not timed: they are the engine's first, colder than any after them
                # (bench preset, batch 1: the first two k = 3 steps took 1.86 and 1.41 ms against 0.85
                # measured at start-up and ~1.03 later, and the policy held k = 1 for 2000 steps).
                # Where a prompt's first drafts wait for its first decode step, that step verifies filler:
                # one step more keeps two verifies of real drafts in the probe.
                k = self._start_probe(self.max_k)
                self._probe_left += int(self.first_drafts_deferred)
                self._untimed = self._probe_left + 1
                return k
            early = None if self._untimed else self._early_probe(batch_size, scores)
            if early is not None:
                return self._start_probe(early)
            best = max(range(len(scores)), key=lambda k: scores[k])
            current = scores[self._current]
            if best != self._current and scores[best] > current * (1 + self.switch_margin):
                if best == 0 and not closed:  # the depth left is probed again soon (module docstring)
                    self._recheck, self._until_probe = self._current, self.recheck_steps
                self._current = best
                self._reference.clear()  # (the last depth's)
                self._probe_scale = 1
            if self.trace is not None:
                self._write_trace("choice", batch=batch_size, closed=closed, k=self._current, scores=scores,
                                  costs=self.step_costs(max(1, batch_size)), acceptance=self.acceptance())
        self._since_probe += 1
        self._until_probe -= 1
        if self._untimed:  # (a probe's steps would not be timed)
            return self._current
        if self._until_probe <= 0 and self._recheck:
            target, self._recheck = self._recheck, 0
            self._until_probe = self._next_probe_gap()
            if self._current == 0 and not closed:  # (a closed batch weighs the long-run acceptance)
                return self._start_probe(target)
        if self._until_probe <= 0:
            # each bucket takes its own turns: a server whose batch fell to 1 and rose to 32 at every turn of
            # the benchmark's clients (k = 3 at 1, k = 2 at 8, k = 1 at 16 and 32) had its higher probes fall
            # at the small batches and its lower ones at 32, where k = 3 was never probed
            turn = self._probe_turns.get(bucket, 0) + 1
            higher = list(range(self._current + 1, self.max_k + 1))
            lower = list(range(self._current))
            # a higher k (its acceptance may have recovered) and a lower k, whose cost is all there is
            # to refresh, in turn (module docstring)
            target = None
            if lower and (turn % 2 == 0 or not higher):
                if turn % 2 == 0:
                    target = lower[(turn // 2) % len(lower)]
            elif higher:  # (every turn at k = 0, else every second one)
                target = higher[(turn // 2 if lower else turn) % len(higher)]
            wait = 0 if target is None else self._probe_wait(target, batch_size)
            if wait:  # a dear probe waits until the steps since the last one pay for it (probe_budget)
                # counted again every quarter interval, at the batch size then: a wait counted for a batch
                # of 32 would hold the probes of the batch of 4 after it, where they cost less
                self._until_probe = min(wait, max(1, self.probe_interval // 4))
                return self._current
            # (a switch sets it back too)
            self._probe_scale = 1 if self._probe_close_call else min(2 * self._probe_scale, self.probe_backoff)
            self._probe_close_call = False
            self._until_probe = self._next_probe_gap()
            self._probe_turns[bucket], self._since_probe = turn, 0
            if target is not None:
                return self._start_probe(target)
        return self._current

    def _drain_lead(self, scores: list[float | None]) -> float:
        """How many times longer a closed batch's choice may stand: its best depth's lead over the next, in
        switch margins (module docstring), at least 1."""
        known = sorted((s for s in scores if s is not None), reverse=True)
        if len(known) < 2 or known[1] <= 0 or not self.drain_lead_hold:
            return 1.0
        return max(1.0, self.drain_lead_hold * (known[0] / known[1] - 1.0) / self.switch_margin)

    def _early_probe(self, batch_size: int, scores: list[float]) -> int | None:
        """A depth whose cost in this bucket is still the start-up's alone, to probe now (module docstring):
        once the depth in use has run this batch size lately (a probe is set against those steps), if its
        score is within early_reach of the depth in use's, and at most `early_probes` times for each
        depth and bucket (a probe not timed, the batch size having moved, is tried again)."""
        bucket = batch_bucket(max(1, batch_size))
        if self._reference.get((bucket, batch_size), (0, 0))[1] < self.reference_steps:
            return None
        # (an open batch's, a server's, probes every depth once a bucket: a few steps in its life)
        floor = (1.0 - self.early_reach) * scores[self._current] if self._probe_closed else 0.0
        for k in range(self.max_k + 1):
            cost = self._costs.get((k, bucket))
            if k != self._current and cost is not None and not cost.live and cost.early < self.early_probes \
                    and scores[k] >= floor:
                cost.early += 1
                return k
        return None

    def _probe_wait(self, k: int, batch_size: int) -> int:
        """Steps a probe of depth k must still wait for its steps' cost above the depth in use's, and the
        draft's fill of the keys steps at k = 0 left out, to be at most `probe_budget` of the time since
        the last probe (module docstring); 0: probe now."""
        costs = self.step_costs(max(1, batch_size))
        now, then = costs[self._current], costs[k]
        if now is None or then is None or then <= now:
            return 0
        extra = self.probe_steps * (then - now)
        if self.unseen_positions is not None and k:  # the fill of the keys steps at k = 0 left out
            extra += self.unseen_positions() * self.draft_pass_seconds()[0]
        paid_by = extra / (self.probe_budget * now)  # steps at the depth in use
        return max(0, math.ceil(paid_by - self._since_probe))

    def _start_probe(self, k: int) -> int:
        self._probe_k, self._probe_left = k, self.probe_steps - 1
        if self.trace is not None:
            self._write_trace("probe", k=k, current=self._current, batch=self._last_batch)
        # the step after the probe weighs its evidence, in an open batch or a closed one (a closed batch's
        # probe of k = 0 was weighed only at the drain's next revision, up to 32 steps later)
        self._revise_wait = self._drain_wait = 0
        return k

    def _next_probe_gap(self) -> int:
        interval = self.probe_interval * self._probe_scale
        spread = interval // 4
        return interval + self._rng.randint(-spread, spread)

    def _write_trace(self, event: str, **fields) -> None:
        """One line of the trace: the event, the time (perf_counter seconds), its fields, and the host time
        a step per bucket."""
        record = {"event": event, "t": round(time.perf_counter(), 6), **fields,
                  "overhead": {str(b): s for b, s in sorted(self._overhead.items())}}
        self.trace.write(json.dumps(record) + "\n")

    def describe(self) -> dict:
        return {"speculative_policy": "adaptive", "num_speculative_tokens": self.max_k}


def make_policy(num_speculative_tokens: int, adaptive: bool, seed: int = 0):
    """The engine's policy for its settings: adaptive depth up to K, or every step at K. With
    $MTP_SPEC_POLICY_TRACE naming a file, an adaptive policy appends its trace there (line-buffered)."""
    if adaptive:
        path = os.environ.get(TRACE_ENV, "").strip()
        trace = None
        if path:
            try:
                trace = open(path, "a", buffering=1, encoding="utf-8")
            except OSError as e:
                raise ValueError(f"${TRACE_ENV}={path!r}: cannot open the policy's trace file: {e}") from e
        return AdaptivePolicy(num_speculative_tokens, seed=seed, trace=trace)
    return FixedPolicy(num_speculative_tokens)
