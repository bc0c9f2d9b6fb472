;;;; sizing.lisp -- how many workers of a group may run: the pool's sizing
;;;; policy, a pure function of what the maker samples.
;;;;
;;;; Every +SAMPLE-MS+ the maker thread (maker.lisp) reads each group into a
;;;; SIZING-SAMPLE and calls DECIDE-SIZE with the group's SIZING-STATE (the
;;;; counters carried from sample to sample).  It answers one of
;;;;
;;;;   :ADD-PERMIT     one more run permit, and a thread to use it
;;;;   :ADD-THREAD     a thread for a permit that no thread holds
;;;;   :REMOVE-PERMIT  one permit above the group's share goes back
;;;;   :HOLD           nothing
;;;;
;;;; and the state for the next sample.  Nothing else is read or changed:
;;;; tests replay recorded samples through it (tests/core/sizing.lisp).
;;;;
;;;; The policy.  A group keeps its SHARE of the usable CPUs as permits:
;;;; more runnable workers than CPUs add preemption, not throughput.  It
;;;; grows only for workers blocked in a handler (a database call, a sleep):
;;;; then a CPU is free and work waits.  A sample finds the group blocked
;;;; when no worker of it is idle, the process uses under +GROWTH-CPU-LIMIT+
;;;; of its CPUs, and a look at its workers' states (the sample's LOOK
;;;; function: the kernel's view of each thread, maker.lisp BLOCKED-WORKERS
;;;; and CONFIRMED-BLOCKED) finds enough of them blocked:
;;;;  - the holders not blocked are fewer than the share or than half the
;;;;    holders, or, when the CPUs were idle lately, any holder is blocked;
;;;;  - at most +RUNNABLE-PER-CPU+ runnable (waiting for a CPU) per CPU, else
;;;;    the CPUs are taken and the look says SATURATED;
;;;;  - at least half of those blocked are blocked for longer than a lock's
;;;;    brief wait (CONFIRMED).
;;;; Blocked in +SAMPLES-BEFORE-GROWTH+ samples in a row, the group grows
;;;; one permit (and thread) a sample while that lasts.  A permit above the
;;;; share goes back when the process uses more than +SHRINK-CPU-LIMIT+ of
;;;; its CPUs, when the group had an idle worker in +IDLE-SAMPLES-BEFORE-
;;;; SHRINK+ samples in a row, or when +SPARE-LOOKS-BEFORE-SHRINK+ looks in
;;;; a row found its permits above the share covering no blocked worker.
;;;; Looks that find too few blocked +QUIET-LOOKS-BEFORE-SPACING+ times in
;;;; a row are spaced to one in +SPACED-LOOK-SAMPLES+ samples.
;;;;
;;;; The constants, each chosen by A/B runs named in doc/design.md:
;;;;
;;;;   +SAMPLE-MS+                    5    a sample (the maker's period)
;;;;   +LOAD-SAMPLES+                 4    the process's CPU use is over 20 ms
;;;;   +GROWTH-CPU-LIMIT+          0.85    no growth above this use of the CPUs
;;;;   +SHRINK-CPU-LIMIT+          0.95    a permit back above it
;;;;   +RUNNABLE-PER-CPU+             3    runnable workers per CPU: saturated
;;;;   +SAMPLES-BEFORE-GROWTH+        2    blocked samples in a row, then grow
;;;;   +IDLE-SAMPLES-BEFORE-SHRINK+ 200    a second with an idle worker
;;;;   +SPARE-LOOKS-BEFORE-SHRINK+   20    looks finding spare permits
;;;;   +QUIET-LOOKS-BEFORE-SPACING+  20    looks finding too few blocked
;;;;   +SPACED-LOOK-SAMPLES+          4    then one look in this many samples
;;;;   +BRIEF-WAIT-MS+               50    a lock's wait lasts less (the look)
;;;;
;;;; Glossary.  Permit: leave to wait in or serve from the group's epoll set
;;;; (ALLOWED permits; HOLDERS: workers holding one).  Share: the group's
;;;; part of the usable CPUs.  Look: a read of the workers' thread states.
;;;; Blocked: serving one event, not runnable, before and after the read.
;;;; Spare: permits above the share that cover no blocked worker.

(in-package #:gallop.core)

(defconstant +sample-ms+ 5
  "The maker's period: one sample of each group.")

(defconstant +load-samples+ 4
  "The process's use of its CPUs (LOAD) is over this many samples, not one:
handlers that sleep wake in bursts, so over 5 ms the use jumps far above and
below its mean.  doc/design.md, \"Idle CPUs and the pool's load\".")

(defconstant +growth-cpu-limit+ 0.85
  "Permits are added only while the process uses less than this share of its CPUs.")

(defconstant +shrink-cpu-limit+ 0.95
  "Above this share of its CPUs, the process gives permits back.")

(defconstant +runnable-per-cpu+ 3
  "Serving workers seen runnable per CPU of a group's share beyond which the
look says the CPUs are taken (SATURATED), unless they were idle lately.  A
snapshot catches a worker runnable while it computes after its handler
wakes, so the limit leaves room for the front end whose requests cost the
most.  doc/design.md, \"Runnable workers per CPU\".")

(defconstant +samples-before-growth+ 2
  "Samples in a row that find a group blocked before it grows: a thread's
state is a snapshot.")

(defconstant +idle-samples-before-shrink+ 200
  "Samples in a row with an idle worker (a second) after which a permit
above the share goes back.")

(defconstant +spare-looks-before-shrink+ 20
  "Looks in a row that found fewer workers blocked than half the permits
above the share, after which one of those goes back.  On a machine shared
with other processes the CPU limits are never crossed, and a handler that
never blocks still waits at times on a lock whose holder was preempted;
this keeps permits added for such waits from ratcheting up.
doc/design.md, \"Lock waits are not blocked handlers\".")

(defconstant +quiet-looks-before-spacing+ 20
  "Looks in a row that found too few workers blocked to grow (100 ms), after
which a group is looked at only every +SPACED-LOOK-SAMPLES+ samples.")

(defconstant +spaced-look-samples+ 4
  "While looks find too few blocked, one sample in this many looks: a group
whose handlers never block would otherwise have each worker's state read
every 5 ms for nothing.  doc/design.md, \"The maker's looks\".")

(defconstant +brief-wait-ms+ 50
  "How long a worker must have been seen waiting briefly (in futex(2) or a
page fault) on one event before the look counts it blocked: longer than a
lock's wait lasts when another process preempted its holder.
doc/design.md, \"Lock waits are not blocked handlers\".")

(defstruct (sizing-sample (:conc-name sample-) (:copier nil))
  "What the maker reads of one group in one sample."
  (idle 0 :type fixnum)                 ; workers waiting in epoll_wait
  (holders 0 :type fixnum)              ; workers holding a permit
  (allowed 1 :type fixnum)              ; permits
  (threads 0 :type fixnum)              ; the group's threads
  (share 1 :type fixnum)                ; its share of the usable CPUs
  (idle-samples 0 :type fixnum)         ; samples in a row with an idle worker
                                        ; (the pool's; reset when a permit goes back)
  (load 0 :type real)                   ; the process's use of its CPUs, 0-1+
  (cpus-idle nil)                       ; the CPUs had time to spare lately
  (room-for-permit nil)                 ; the pool's permits < MAX-THREADS
  (room-for-thread nil)                 ; the pool's threads < MAX-THREADS
  ;; The look at the workers' states, taken only when the policy needs it:
  ;; (LOOK LIMIT) answers (values BLOCKED SATURATED), BLOCKED counted no
  ;; further than LIMIT; then, only if growth still looks due, (CONFIRM
  ;; BLOCKED) how many of them are blocked for longer than a brief wait.
  (look nil :type (or null function))
  (confirm nil :type (or null function)))

(defstruct (sizing-state (:conc-name sizing-) (:copier nil))
  "A group's counters, carried from one sample to the next."
  (blocked-samples 0 :type fixnum)      ; in a row found blocked
  (quiet-looks 0 :type fixnum)          ; looks in a row that found too few blocked
  (look-in 0 :type fixnum)              ; samples left before the next look
  (spare-looks 0 :type fixnum))         ; looks in a row that found spare permits

(defun decide-size (sample state)
  "The sizing decision for one group in one sample (see the header): one of
:ADD-PERMIT, :ADD-THREAD, :REMOVE-PERMIT or :HOLD, and the group's next
SIZING-STATE.  Calls the sample's LOOK and CONFIRM at most once each;
reads and changes nothing else."
  (let* ((share (sample-share sample))
         (allowed (sample-allowed sample))
         (threads (sample-threads sample))
         (load (sample-load sample))
         (room-for-permit (sample-room-for-permit sample))
         (room-for-thread (and (< threads allowed) (sample-room-for-thread sample)))
         (above-share (- allowed share))
         (blocked-samples (sizing-blocked-samples state))
         (quiet-looks (sizing-quiet-looks state))
         (look-in (sizing-look-in state))
         (spare-looks (sizing-spare-looks state))
         (grow nil))
    (when (and (zerop (sample-idle sample))
               (< load +growth-cpu-limit+)
               (or room-for-permit room-for-thread (plusp above-share)))
      (if (plusp look-in)
          (decf look-in)
          ;; Enough holders blocked: those not blocked are fewer than the
          ;; share or half the holders (the look counts up to one past that
          ;; edge, which is at least half of ABOVE-SHARE); or, with the CPUs
          ;; idle lately, any.  Half of those found confirmed (lock waits
          ;; of the handlers' own, or the allocator's, should not hold
          ;; growth back).
          (let* ((holders (sample-holders sample))
                 (enough (max share (ceiling holders 2))))
            (multiple-value-bind (blocked saturated)
                (funcall (sample-look sample) (- holders enough -1))
              (setf grow (and (or room-for-permit room-for-thread)
                              (or (> blocked (- holders enough))
                                  (and (sample-cpus-idle sample) (plusp blocked)))
                              (>= (* 2 (funcall (sample-confirm sample) blocked)) blocked)))
              (if grow
                  (setf quiet-looks 0 look-in 0)
                  (setf quiet-looks (min (1+ quiet-looks) +quiet-looks-before-spacing+)
                        look-in (if (>= quiet-looks +quiet-looks-before-spacing+)
                                    (1- +spaced-look-samples+)
                                    0)))
              ;; (Workers that want the CPUs are not spare either.)
              (setf spare-looks (if (< (* 2 (if saturated above-share blocked)) above-share)
                                    (1+ spare-looks)
                                    0))))))
    (setf blocked-samples (if grow (1+ blocked-samples) 0))
    (let ((decision
            (cond ((>= blocked-samples +samples-before-growth+)
                   ;; A free permit with no thread to take it: a thread.
                   ;; Else a permit, and a thread for it.
                   (cond ((and (>= threads allowed) room-for-permit) :add-permit)
                         ((< threads allowed) :add-thread)
                         (t :hold)))
                  ((and (plusp above-share)
                        (or (> load +shrink-cpu-limit+)
                            (> (sample-idle-samples sample) +idle-samples-before-shrink+)
                            (>= spare-looks +spare-looks-before-shrink+)))
                   (setf spare-looks 0)
                   :remove-permit)
                  (t :hold))))
      (values decision
              (make-sizing-state :blocked-samples blocked-samples :quiet-looks quiet-looks
                                 :look-in look-in :spare-looks spare-looks)))))
