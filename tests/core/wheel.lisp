;;;; wheel.lisp -- GALLOP.CORE's timing wheel of connection deadlines, driven
;;;; with explicit times: no sockets, no clock, no sleeping, milliseconds.
;;;;
;;;; The wheel's contract (wheel.lisp): a scheduled connection is brought up
;;;; (passed to WHEEL-ADVANCE's function) no later than its deadline rounded
;;;; up to a tick, once per entry that counts; the function decides whether
;;;; it expired, and schedules it again if not.  Deadlines beyond the wheel's
;;;; span are brought up early, at the span's end, for that.  WHEEL-EXPIRE
;;;; plays the housekeeper's part (EXPIRE in housekeeper.lisp): a connection
;;;; brought up before its deadline is scheduled again, else it expires.
;;;; The connections are bare CONNECTION objects: no fd, no engine; the wheel
;;;; touches only their WHEEL-TICK, WHEEL-ENTRY and (here) DEADLINE slots.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the timing wheel
;;;; (timers/wheel.lisp), its connections' deadline slots, and the eventfd
;;;; and timerfd calls it wakes with (os/syscalls.lisp): the wheel is the
;;;; thing tested, with explicit times.

(in-package #:gallop-tests)

(in-suite core)

(defconstant +wheel-base-tick+ 1000
  "The tick the test wheels start at: time 100000 ms.")

(defun wheel-base-ms ()
  (* +wheel-base-tick+ gallop.core::+tick-ms+))

(defun wheel-span-ms ()
  (* gallop.core::+slots+ gallop.core::+tick-ms+))

(defun test-wheel ()
  (gallop.core::make-wheel +wheel-base-tick+))

(defun wheel-connection ()
  (make-instance 'gallop.core:connection :fd -1))

(defun wheel-set (wheel c deadline)
  "Set C's deadline and schedule it, as GALLOP.CORE::SCHEDULE does."
  (setf (gallop.core::connection-deadline c) deadline)
  (gallop.core::wheel-schedule wheel c deadline))

(defun wheel-step (wheel now &key (expire t))
  "One WHEEL-ADVANCE to NOW.  With EXPIRE, as the housekeeper: a connection
brought up before its deadline is scheduled again, else it expires.  Without,
every connection brought up counts as expired.  Returns two lists of
\(CONNECTION . NOW): the expired ones and all those brought up."
  (let ((expired '()) (raised '()))
    (gallop.core::wheel-advance
     wheel now
     (lambda (c)
       (push (cons c now) raised)
       (if (or (not expire) (<= (gallop.core::connection-deadline c) now))
           (push (cons c now) expired)
           (gallop.core::wheel-schedule wheel c (gallop.core::connection-deadline c)
                                        :from-advance t))))
    (values (nreverse expired) (nreverse raised))))

(defun wheel-run (wheel from to &key (step 1) (expire t))
  "WHEEL-STEP at FROM, FROM + STEP, ... and at TO: the expired and the raised,
in order."
  (let ((expired '()) (raised '()))
    (flet ((one (now)
             (multiple-value-bind (e r) (wheel-step wheel now :expire expire)
               (setf expired (nconc expired e) raised (nconc raised r)))))
      (loop for now from from below to by step do (one now))
      (one to))
    (values expired raised)))

(defun times-of (c log)
  "The times at which C appears in LOG, a list of (CONNECTION . NOW)."
  (loop for (d . now) in log when (eq c d) collect now))

(defun expected-expiry (deadline)
  "When a connection scheduled at the base tick with DEADLINE expires: at its
deadline rounded up to a tick, but no earlier than two ticks on (an entry is
never pushed for the tick the housekeeper may be processing)."
  (* gallop.core::+tick-ms+
     (max (gallop.core::deadline-tick deadline) (+ 2 +wheel-base-tick+))))

(defun expiry-problems (cases expired &key (raised expired) (check-raised t) (late-ticks 0))
  "CASES: a list of (CONNECTION DEADLINE).  The problems: a connection that
did not expire exactly once, at EXPECTED-EXPIRY (or up to LATE-TICKS after
it, never before); or (with CHECK-RAISED) was brought up before its
deadline at all."
  (loop for (c deadline) in cases
        for times = (times-of c expired)
        for expected = (expected-expiry deadline)
        unless (and (= 1 (length times))
                    (<= expected (first times)
                        (+ expected (* late-ticks gallop.core::+tick-ms+))))
          collect (list :deadline deadline :expired-at times :expected expected)
        when (and check-raised (some (lambda (now) (< now deadline)) (times-of c raised)))
          collect (list :deadline deadline :raised-early (times-of c raised))))

(defun early-problems (cases raised)
  "CASES: a list of (CONNECTION DEADLINE).  The times a connection was brought
up before its deadline other than at the end of the wheel's span, counted
from the base tick (its last slot, from which a deadline beyond the span is
scheduled again)."
  (loop for (c deadline) in cases
        nconc (loop for now in (times-of c raised)
                    when (and (< now deadline)
                              (/= 0 (mod (- (floor now gallop.core::+tick-ms+) +wheel-base-tick+)
                                         (1- gallop.core::+slots+))))
                      collect (list :deadline deadline :raised-at now))))

(defun report-wheel-problems (what problems)
  (is (null problems) "~A: ~D wrong, e.g. ~S" what (length problems)
      (subseq problems 0 (min 5 (length problems)))))

(test wheel-deadline-tick-rounds-up
  (is (equal '(0 1 1 2 2 2 3 -1 0)
             (mapcar #'gallop.core::deadline-tick '(0 1 100 101 199 200 201 -100 -99)))))

(test wheel-brings-each-deadline-up-once-at-its-tick-never-before
  ;; Deadlines around tick boundaries, within the span, at its end and
  ;; several revolutions (51.2 s each) beyond it; advanced 1 ms at a time.
  (let* ((base (wheel-base-ms))
         (span (wheel-span-ms))
         (offsets (list 1 99 100 101 199 200 201 250 299 300 301 1000 12345
                        (- span 200) (- span 101) (- span 100) (- span 99) (- span 1) span
                        (1+ span) (+ span 100) (+ span 300) (* 2 span) (1+ (* 2 span))
                        (+ (* 3 span) 4321) (* 4 span)))
         (within (remove-if (lambda (d) (> (gallop.core::deadline-tick (+ base d))
                                           (+ +wheel-base-tick+ gallop.core::+slots+ -1)))
                            offsets)))
    (is (< (length within) (length offsets)) "some deadlines lie beyond the span")
    ;; As the housekeeper does: each expires once, never before its
    ;; deadline, on time (or a tick late: see
    ;; WHEEL-RESCHEDULED-DEADLINES-ARE-NOT-A-TICK-LATE).
    (let* ((wheel (test-wheel))
           (cases (loop for d in offsets
                        collect (let ((c (wheel-connection)))
                                  (wheel-set wheel c (+ base d))
                                  (list c (+ base d))))))
      (multiple-value-bind (expired raised) (wheel-run wheel base (+ base (* 5 span)))
        (report-wheel-problems "expired" (expiry-problems cases expired :raised raised
                                                                        :check-raised nil
                                                                        :late-ticks 0))
        (report-wheel-problems "brought up early" (early-problems cases raised))))
    ;; Without rescheduling: a deadline within the span is brought up exactly
    ;; once, on time, never before.
    (let* ((wheel (test-wheel))
           (cases (loop for d in within
                        collect (let ((c (wheel-connection)))
                                  (wheel-set wheel c (+ base d))
                                  (list c (+ base d))))))
      (multiple-value-bind (expired raised) (wheel-run wheel base (+ base (* 3 span)) :expire nil)
        (report-wheel-problems "brought up" (expiry-problems cases expired :raised raised))))))

(test wheel-far-deadlines-are-not-brought-up-an-earlier-lap
  ;; A deadline one revolution and three ticks away hashes to the slot three
  ;; ticks on: it must not expire there, nor one lap later than it should.
  (let* ((base (wheel-base-ms))
         (span (wheel-span-ms))
         (wheel (test-wheel))
         (cases (loop for laps from 1 to 4
                      nconc (loop for extra in '(-100 -1 0 1 100 300 5000)
                                  collect (let ((c (wheel-connection))
                                                (deadline (+ base (* laps span) extra)))
                                            (wheel-set wheel c deadline)
                                            (list c deadline))))))
    ;; 4 ms steps: every tick's first millisecond is one of them
    (multiple-value-bind (expired raised) (wheel-run wheel base (+ base (* 6 span)) :step 4)
      ;; (a tick late at most: see WHEEL-RESCHEDULED-DEADLINES-ARE-NOT-A-TICK-LATE)
      (report-wheel-problems "expired" (expiry-problems cases expired :raised raised
                                                                      :check-raised nil
                                                                      :late-ticks 0))
      (report-wheel-problems "brought up early" (early-problems cases raised)))))

(test wheel-rescheduled-deadlines-are-not-a-tick-late
  ;; The invariant (wheel.lisp): a connection is looked at no later than its
  ;; deadline rounded up to a tick.  A connection brought up one tick before
  ;; its deadline tick, and scheduled again from WHEEL-ADVANCE's function (as
  ;; EXPIRE does), is pushed two ticks on (the CURRENT + 2 rule, meant for
  ;; other threads), so it is looked at one tick (100 ms) late.  That happens
  ;; to a deadline in the tick just past the span's last slot (base + 51.1 s
  ;; + 1 ms to base + 51.2 s), to one a tick past a later bring-up from that
  ;; slot (base + 102.4 s - 100 ms), and to a deadline moved one tick later
  ;; (lazily: its old entry brings it up a tick early).
  (let* ((base (wheel-base-ms))
         (span (wheel-span-ms))
         (wheel (test-wheel))
         (moved (wheel-connection))
         (cases (loop for deadline in (list (+ base span -99) (+ base span)
                                            (+ base (* 2 span) -100))
                      collect (let ((c (wheel-connection)))
                                (wheel-set wheel c deadline)
                                (list c deadline)))))
    (wheel-set wheel moved (+ base 1000))
    (wheel-set wheel moved (+ base 1100))
    (push (list moved (+ base 1100)) cases)
    (report-wheel-problems "expired late"
                           (expiry-problems cases (wheel-run wheel base (+ base (* 3 span)))
                                            :check-raised nil))))

(test wheel-past-deadlines-fire-on-the-next-advances
  ;; Deadlines already past (or due this tick) come up as soon as an entry
  ;; may be put: two ticks on.  A housekeeper advancing every tick sees
  ;; them within 200 ms; one advance far ahead sees them at once.
  (let* ((base (wheel-base-ms))
         (deadlines (list -5 0 1 (- base 100000) (- base 101) (- base 1) base (+ base 1)
                          (+ base 99) (+ base 100) (+ base 199))))
    (let* ((wheel (test-wheel))
           (cs (loop for d in deadlines collect (let ((c (wheel-connection))) (wheel-set wheel c d) c))))
      (let ((expired (append (wheel-step wheel (+ base 100))
                             (wheel-step wheel (+ base 200)))))
        (is (= (length cs) (length expired)) "~D of ~D expired" (length expired) (length cs))
        (is (every (lambda (c) (equal (times-of c expired) (list (+ base 200)))) cs)))
      (is (null (nth-value 1 (wheel-run wheel (+ base 201) (+ base (* 3 (wheel-span-ms))) :step 50)))
          "none comes up again"))
    (let* ((wheel (test-wheel))
           (cs (loop for d in deadlines collect (let ((c (wheel-connection))) (wheel-set wheel c d) c)))
           (expired (wheel-step wheel (+ base 1000000))))
      (is (= (length cs) (length expired)))
      (is (every (lambda (c) (= 1 (length (times-of c expired)))) cs)))))

(test wheel-rescheduling-moves-an-entry
  (let ((base (wheel-base-ms))
        (end (+ (wheel-base-ms) (* 3 (wheel-span-ms)))))
    ;; later: it expires at the new deadline only
    (let ((wheel (test-wheel)) (c (wheel-connection)))
      (wheel-set wheel c (+ base 1000))
      (wheel-set wheel c (+ base 5000))
      (let ((expired (wheel-run wheel base end)))
        (is (equal (list (+ base 5000)) (times-of c expired)))))
    ;; earlier: brought up once, at the new deadline; the old entry is stale
    (let ((wheel (test-wheel)) (c (wheel-connection)))
      (wheel-set wheel c (+ base 5000))
      (wheel-set wheel c (+ base 1000))
      (is (= (+ +wheel-base-tick+ 10) (gallop.core::connection-wheel-tick c)))
      (multiple-value-bind (expired raised) (wheel-run wheel base end :expire nil)
        (is (equal (list (+ base 1000)) (times-of c expired)))
        (is (equal (list (+ base 1000)) (times-of c raised))))
      (is (= -1 (gallop.core::connection-wheel-tick c)) "no entry counts after it came up"))
    ;; earlier, then scheduled by its own bring-up for the old tick: the
    ;; stale entry and the new one share a slot; it comes up once there
    (let ((wheel (test-wheel)) (c (wheel-connection)) (raised '()))
      (wheel-set wheel c (+ base 5000))
      (wheel-set wheel c (+ base 1000))
      (loop for now from base to end by 10
            do (gallop.core::wheel-advance
                wheel now (lambda (d)
                            (push now raised)
                            (when (= now (+ base 1000))
                              (gallop.core::wheel-schedule wheel d (+ base 5000))))))
      (is (equal (list (+ base 1000) (+ base 5000)) (reverse raised))))
    ;; the same deadline many times: one entry, one bring-up
    (let ((wheel (test-wheel)) (c (wheel-connection)))
      (dotimes (i 10) (wheel-set wheel c (+ base 2000)))
      (is (equal (list (+ base 2000)) (times-of c (wheel-run wheel base end :expire nil)))))
    ;; earlier and earlier: once, at the earliest
    (let ((wheel (test-wheel)) (c (wheel-connection)))
      (loop for d from 9000 downto 1000 by 1000 do (wheel-set wheel c (+ base d)))
      (is (equal (list (+ base 1000)) (times-of c (wheel-run wheel base end :expire nil)))))
    ;; after it came up, it can be scheduled again
    (let ((wheel (test-wheel)) (c (wheel-connection)))
      (wheel-set wheel c (+ base 1000))
      (is (equal (list (+ base 1000)) (times-of c (wheel-run wheel base (+ base 2000) :expire nil))))
      (wheel-set wheel c (+ base 4000))
      (is (equal (list (+ base 4000))
                 (times-of c (wheel-run wheel (+ base 2001) end :expire nil)))))))

(test wheel-forget-removes-an-entry
  (let ((base (wheel-base-ms))
        (end (+ (wheel-base-ms) (* 3 (wheel-span-ms)))))
    ;; forgotten: never brought up; the others of its slot still are
    (let* ((wheel (test-wheel))
           (gone (wheel-connection))
           (others (loop repeat 5 collect (wheel-connection))))
      (dolist (c others) (wheel-set wheel c (+ base 1500)))
      (wheel-set wheel gone (+ base 1450))  ; the same tick
      (gallop.core::wheel-forget gone)
      (let ((raised (wheel-run wheel base end :expire nil)))
        (is (null (times-of gone raised)))
        (is (every (lambda (c) (equal (list (+ base 1500)) (times-of c raised))) others))))
    ;; forgotten after its deadline moved earlier: neither entry brings it up
    (let ((wheel (test-wheel)) (c (wheel-connection)))
      (wheel-set wheel c (+ base 5000))
      (wheel-set wheel c (+ base 1000))
      (gallop.core::wheel-forget c)
      (is (null (wheel-run wheel base end :expire nil))))
    ;; forgotten beyond the span: not brought up at the span's end either
    (let ((wheel (test-wheel)) (c (wheel-connection)))
      (wheel-set wheel c (+ base (* 2 (wheel-span-ms))))
      (gallop.core::wheel-forget c)
      (is (null (wheel-run wheel base end :step 13))))
    ;; never scheduled, or forgotten twice, or after it came up: no error
    (let ((wheel (test-wheel)) (c (wheel-connection)) (d (wheel-connection)))
      (finishes (gallop.core::wheel-forget c))
      (wheel-set wheel d (+ base 700))
      (is (= 1 (length (wheel-run wheel base (+ base 1000) :expire nil))))
      (finishes (gallop.core::wheel-forget d))
      (finishes (gallop.core::wheel-forget d)))
    ;; closed by the bring-up of another of its slot: not brought up itself
    (let* ((wheel (test-wheel))
           (a (wheel-connection))
           (b (wheel-connection))
           (raised '()))
      (wheel-set wheel a (+ base 800))
      (wheel-set wheel b (+ base 800))
      (gallop.core::wheel-advance wheel end
                                  (lambda (c)
                                    (push c raised)
                                    (gallop.core::wheel-forget (if (eq c a) b a))))
      (is (= 1 (length raised)) "brought up ~D times" (length raised)))))

(test wheel-many-entries-in-one-slot
  (let* ((base (wheel-base-ms))
         (span (wheel-span-ms))
         (wheel (test-wheel))
         ;; 2000 deadlines in one tick, and 500 in the same slot a lap later
         (first-lap (loop for i from 0 below 2000
                    collect (let ((c (wheel-connection)))
                              (wheel-set wheel c (+ base 3001 (mod i 100)))
                              c)))
         (later (loop for i from 0 below 500
                      collect (let ((c (wheel-connection)))
                                (wheel-set wheel c (+ base span 3001 (mod i 100)))
                                c))))
    (is (null (wheel-step wheel (+ base 3099))))
    (let ((expired (wheel-step wheel (+ base 3100))))
      (is (= 2000 (length expired)))
      (is (null (set-difference first-lap (mapcar #'car expired))))
      (is (= 2000 (length (remove-duplicates (mapcar #'car expired))))))
    (is (null (wheel-run wheel (+ base 3101) (+ base span 3099) :step 100))
        "nothing between the laps")
    (let ((expired (wheel-step wheel (+ base span 3100))))
      (is (= 500 (length expired)))
      (is (null (set-difference later (mapcar #'car expired)))))
    (is (null (wheel-run wheel (+ base span 3101) (+ base (* 4 span)) :step 100)))))

(test wheel-advancing-many-ticks-at-once-fires-everything-due
  (let* ((base (wheel-base-ms))
         (span (wheel-span-ms))
         (random (sb-ext:seed-random-state 2024))
         (wheel (test-wheel))
         (cases (loop repeat 3000
                      collect (let ((c (wheel-connection))
                                    (deadline (+ base -1000 (random (* 5 span) random))))
                                (wheel-set wheel c deadline)
                                (list c deadline))))
         (middle (+ base (* 2 span) 3700)))
    ;; one call to MIDDLE: exactly those due by then, once each
    (let ((expired (wheel-step wheel middle)))
      (is (= (floor middle gallop.core::+tick-ms+) (gallop.core::wheel-current wheel)))
      (report-wheel-problems
       "first call"
       (loop for (c deadline) in cases
             for times = (times-of c expired)
             for due = (<= (expected-expiry deadline) middle)
             unless (equal times (if due (list middle) '()))
               collect (list :deadline deadline :due due :expired times))))
    ;; time does not run back: an earlier NOW does nothing
    (is (null (wheel-step wheel base)))
    (is (= (floor middle gallop.core::+tick-ms+) (gallop.core::wheel-current wheel)))
    ;; one more call, far on: all the others
    (let* ((end (+ base (* 7 span)))
           (expired (wheel-step wheel end)))
      (report-wheel-problems
       "second call"
       (loop for (c deadline) in cases
             for times = (times-of c expired)
             for due = (> (expected-expiry deadline) middle)
             unless (equal times (if due (list end) '()))
               collect (list :deadline deadline :due due :expired times))))
    (is (null (wheel-step wheel (+ base (* 20 span)))) "and nothing after")))

(test a-resting-wheel-is-woken-by-the-push-that-ends-its-rest
  "The housekeeper rests while its wheel holds no connection (WHEEL-REST),
and the thread whose push ends the rest signals its eventfd: a deadline set
by another thread while it rests is not left a second late."
  (let* ((wheel (test-wheel))
         (fd (gallop.core::make-eventfd))
         (c (wheel-connection)))
    (unwind-protect
         (flet ((signalled-p ()
                  ;; Whether the (non-blocking) eventfd had a count to read;
                  ;; reading resets it.
                  (= 8 (gallop.core::read-timerfd fd))))
           (setf (gallop.core::wheel-wake-fd wheel) fd)
           (is-true (gallop.core::wheel-rest wheel) "an empty wheel rests")
           (is-true (gallop.core::wheel-resting wheel))
           (is (not (signalled-p)))
           (sb-thread:join-thread
            (sb-thread:make-thread (lambda () (wheel-set wheel c (+ (wheel-base-ms) 5000)))))
           (is (null (gallop.core::wheel-resting wheel)) "the push ended the rest")
           (is-true (signalled-p) "and woke the housekeeper")
           (is (null (gallop.core::wheel-rest wheel)) "a wheel holding a connection does not rest")
           (is (null (gallop.core::wheel-resting wheel)))
           ;; A later deadline pushes nothing, and wakes no one.
           (wheel-set wheel c (+ (wheel-base-ms) 9000))
           (is (not (signalled-p)))
           ;; Closed: its entry is emptied, and the wheel may rest again.
           (gallop.core::wheel-forget c)
           (is-true (gallop.core::wheel-rest wheel))
           (wheel-set wheel (wheel-connection) (+ (wheel-base-ms) 5000))
           (is-true (signalled-p)))
      (gallop.core::close-fd fd))))
