;;;; timers.lisp -- the application timers' heap
;;;; (src/core/timers/timers.lisp), on its own: due timers come out in
;;;; deadline order, each once; cancelled ones never.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the application timers'
;;;; heap (timers/timers.lisp), tested on its own.

(in-package #:gallop-tests)

(in-suite core)

(test timers-fire-due-timers-in-deadline-order-each-once
  (let ((timers (gallop.core::make-timers))
        (random-state (sb-ext:seed-random-state 42))
        (fired '())
        (cancelled '()))
    (unwind-protect
         (let ((entries
                 (loop for i below 1000
                       for delay = (/ (random 50 random-state) 1000)
                       collect (cons i (gallop.core::timers-schedule
                                        timers delay (let ((i i)) (lambda () (push i fired))))))))
           (is (= 1000 (gallop.core::timers-pending timers)))
           ;; Every third one cancelled: true once, then NIL.
           (loop for (i . timer) in entries
                 when (zerop (mod i 3))
                   do (is (eq t (gallop.core:cancel-timer timer)))
                      (is (null (gallop.core:cancel-timer timer)))
                      (push i cancelled))
           (sleep 0.1)                    ; every deadline has passed
           (gallop.core::timers-fire timers #'funcall)
           (let ((order (reverse fired)))
             (is (= (- 1000 (length cancelled)) (length order)))
             (is (null (intersection order cancelled)))
             (is (= (length order) (length (remove-duplicates order))))
             ;; In deadline order.
             (let ((deadline (lambda (i) (gallop.core::timer-deadline (cdr (assoc i entries))))))
               (is (every (lambda (a b) (<= (funcall deadline a) (funcall deadline b)))
                          order (rest order)))))
           (is (zerop (gallop.core::timers-pending timers)))
           (is (zerop (gallop.core::timers-count timers)))
           ;; Not due yet: stays; a later fire runs it.
           (gallop.core::timers-schedule timers 60 (lambda () (push :late fired)))
           (gallop.core::timers-fire timers #'funcall)
           (is (not (member :late fired)))
           (is (= 1 (gallop.core::timers-pending timers))))
      (gallop.core::free-timers timers))))
